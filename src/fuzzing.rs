//! Entry points of the fuzz targets (`fuzz/fuzz_targets/*.rs`). Each takes arbitrary
//! bytes, runs one piece of the code a client or an operator feeds, and asserts what
//! must hold for any input: no panic, and the invariants written at each function. The
//! cargo-fuzz targets and `tests/repo/fuzz_corpus.rs` (which replays every corpus file on
//! the stable toolchain) call the same functions, so a crash found once stays fixed.
//!
//! Inputs are text, one field per line, so a corpus file can be read and written by
//! hand; a line that does not parse is skipped rather than ending the run. (The
//! `response` target's input is a mode byte, then the bytes as an upstream sends them.)
//!
//! Differential targets compare sluice with an oracle written from the RFC:
//! `rfc9112` holds the rules requests and responses share, `response` and `request`
//! the rest of each side. Behind the `fuzzing` feature: none of it is in the product.

use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;

use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::Request;

use crate::config::compile::{compile, CompileError};
use crate::config::value::{
    fmt_dur, fmt_rate, interpolate_with, parse_duration, parse_net, parse_rate, parse_size,
};
use crate::identity::{canonical, parse_hop, ClientKey, KeyPart, KeySpec, TrustedProxies};
use crate::limit::{decide, State};
use crate::telemetry::metrics::Metrics;
use crate::upstream::BuildError;

pub mod request;
mod response;
pub mod rfc9112;
pub use response::{response, rfc_response, BodyEnd, BodyLength, RfcHead, RfcResponse};

/// A fuzz target's entry point: panics on an input that breaks an invariant.
pub type Target = fn(&[u8]);

/// The fuzz targets, by name, for the corpus test: `fuzz/corpus/NAME/` holds the inputs
/// of `fuzz/fuzz_targets/NAME.rs`.
pub const TARGETS: &[(&str, Target)] = &[
    ("config", config),
    ("duration_rate", duration_rate),
    ("client_ip", client_ip),
    ("key", key),
    ("path", path),
    ("response", response),
    ("request", request::request),
];

/// A configuration file: parsed and validated; when valid, summarised, shown as
/// `/admin/config` shows it, compiled, and each limit plan run for a few requests.
///
/// - `parse` never panics, and a rejected file has at least one error, each inside
///   the file (line 0 only for an error with no place).
/// - What `/admin/config` shows (the file serialized) is itself a valid file that
///   reads back to the same thing.
/// - A valid file compiles: validation rejects everything compile cannot build
///   (only the outside world, a CA file, may still fail; the fuzzer's files have none).
/// - No compiled limit panics or overflows on its first requests, at time 0 or late.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let path = Path::new("fuzz.yaml");
    let loaded = match crate::config::parse(text, path) {
        Ok(l) => l,
        Err(errors) => {
            assert!(!errors.0.is_empty(), "rejected without an error: {text:?}");
            // Lines as YAML counts them (`\r\n`, `\r` and `\n` each end one), and the
            // one just past the end, where a missing field is reported.
            let lines = text.replace("\r\n", "\n").matches(['\r', '\n']).count() + 2;
            for e in &errors.0 {
                assert!(e.line <= lines, "{e} is past the end of {text:?}");
                let _ = e.to_string();
            }
            return;
        }
    };
    let _ = crate::config::summary::summary(&loaded);

    let shown = serde_json::to_string(&loaded.file).expect("a loaded file serializes");
    let again = crate::config::parse(&shown, path)
        .unwrap_or_else(|e| panic!("the file as shown does not load:\n{shown}\n{e}"));
    assert_eq!(
        serde_json::to_string(&again.file).expect("serializes"),
        shown,
        "the file as shown reads back differently"
    );

    // The fuzzer must not read the machine's files (a CA path of /dev/zero never ends).
    let mut loaded = loaded;
    for u in loaded.file.upstreams.values_mut() {
        u.tls_ca = None;
    }
    // Nor write them: no access log file.
    if let Some(a) = &mut loaded.file.access_log {
        a.path = None;
    }
    let runtime = match compile(&loaded, &Metrics::new(), None) {
        Ok(r) => r,
        Err(CompileError::Upstream(BuildError::Ca { .. })) => return,
        Err(e) => panic!("validated but does not compile: {e}\n{text}"),
    };
    for route in &runtime.routes {
        let Some(limits) = &route.limits else {
            continue;
        };
        let tiers = std::iter::once(&limits.default).chain(limits.overrides.values().map(|t| &**t));
        for tier in tiers {
            for start in [0, u64::MAX / 2, u64::MAX - 1] {
                let mut states: Vec<State> = Vec::new();
                for step in 0..3u64 {
                    let (_, new) = decide(&tier.plan, &states, start.saturating_add(step));
                    if let Some(new) = new {
                        states = new;
                    }
                }
            }
        }
    }
}

/// A line of text as a duration, a rate, a size and an interpolated string.
///
/// - A duration that parses prints (`fmt_dur`) as text that parses to the same duration;
///   likewise a rate (`fmt_rate`) and a size.
/// - Interpolation never panics, and text without `$` is left as it is.
pub fn duration_rate(data: &[u8]) {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    if let Some(d) = parse_duration(s) {
        let shown = fmt_dur(d);
        assert_eq!(parse_duration(&shown), Some(d), "{s:?} prints as {shown:?}");
    }
    if let Some(r) = parse_rate(s) {
        let shown = fmt_rate(r);
        assert_eq!(parse_rate(&shown), Some(r), "{s:?} prints as {shown:?}");
    }
    if let Some(n) = parse_size(s) {
        assert_eq!(parse_size(&n.to_string()), Some(n), "{s:?}");
    }
    let env = |name: &str| (name == "SET").then(|| "value".to_string());
    match interpolate_with(s, env) {
        Ok(out) if !s.contains('$') => assert_eq!(out, s),
        _ => {}
    }
}

/// `client_ip` over a trusted list, a peer and `X-Forwarded-For` values.
///
/// Input lines: trusted blocks separated by spaces or commas; the peer address; then
/// one header value per line (raw bytes).
///
/// - An untrusted peer (or an empty trusted list) is the client, whatever it sends.
/// - Otherwise the client is the peer or an address written in the header.
/// - An untrusted address, once chosen, cannot be changed by the client: whatever is
///   added to the left of the header (where a client writes) leaves it as it is.
pub fn client_ip(data: &[u8]) {
    let mut lines = data.split(|b| *b == b'\n');
    let trusted_line = String::from_utf8_lossy(lines.next().unwrap_or_default());
    let nets = trusted_line
        .split([' ', ','])
        .filter_map(|s| parse_net(s.trim()))
        .collect();
    let trusted = TrustedProxies::new(nets);
    let peer = std::str::from_utf8(lines.next().unwrap_or_default())
        .ok()
        .and_then(|s| s.trim().parse::<IpAddr>().ok())
        .unwrap_or(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)));
    let values: Vec<HeaderValue> = lines
        .filter_map(|l| HeaderValue::from_bytes(l).ok())
        .collect();
    let mut headers = HeaderMap::new();
    for v in &values {
        headers.append("x-forwarded-for", v.clone());
    }

    let ip = trusted.client_ip(peer, &headers);
    if !trusted.contains(peer) {
        assert_eq!(ip, canonical(peer), "an untrusted peer chose {ip}");
        return;
    }
    let written = values
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(parse_hop);
    assert!(
        ip == canonical(peer) || written.clone().any(|w| w == ip),
        "{ip} is neither the peer {peer} nor in the header"
    );
    if !trusted.contains(ip) {
        for spoof in ["198.51.100.66", "nonsense", "10.0.0.1, 203.0.113.5", ""] {
            // A header line of the client's own, before the others...
            let mut before = HeaderMap::new();
            before.append("x-forwarded-for", HeaderValue::from_static(spoof));
            for v in &values {
                before.append("x-forwarded-for", v.clone());
            }
            assert_eq!(
                trusted.client_ip(peer, &before),
                ip,
                "{spoof:?} added before"
            );
            // ...or written into the left-most value.
            let Some(Ok(first)) = values.first().map(|v| v.to_str()) else {
                continue;
            };
            let mut joined = HeaderMap::new();
            let first = HeaderValue::from_str(&format!("{spoof}, {first}")).expect("text");
            joined.append("x-forwarded-for", first);
            for v in &values[1..] {
                joined.append("x-forwarded-for", v.clone());
            }
            assert_eq!(trusted.client_ip(peer, &joined), ip, "{spoof:?} prepended");
        }
    }
}

/// Key extraction over arbitrary headers, query and cookies; or, for an input
/// `spellings NORMALIZE VALUE`, over the bodies an upstream reads as one field
/// (`key_spellings`).
///
/// Input lines: the key's parts separated by spaces (`ip header:x-api-key cookie:s
/// query:k global`); the request target (`/path?query`); then one `name: value`
/// header per line (raw bytes).
///
/// - A key that is found is never empty, nor any part of it.
/// - Every part's value is one the deny list sees (`any_value`): a denied key is
///   denied however it is sent.
/// - A composite key splits back into its parts (two different lists never join to
///   one key).
/// - The stored form is short and never holds a Redis hash tag.
pub fn key(data: &[u8]) {
    if let Some(rest) = data.strip_prefix(b"spellings ") {
        return key_spellings(rest);
    }
    if let Some(rest) = data.strip_prefix(b"jwt ") {
        return key_token(rest);
    }
    let mut lines = data.split(|b| *b == b'\n');
    let spec_line = String::from_utf8_lossy(lines.next().unwrap_or_default());
    let mut parts: Vec<KeyPart> = spec_line.split(' ').filter_map(KeyPart::parse).collect();
    if parts.is_empty() {
        parts.push(KeyPart::Header(HeaderName::from_static("x-api-key")));
    }
    let spec = KeySpec::new(parts);
    let uri = lines.next().unwrap_or_default();
    let mut req = Request::builder().uri(uri);
    if req.uri_ref().is_none() {
        req = Request::builder().uri("/");
    }
    for line in lines {
        let Some(colon) = line.iter().position(|b| *b == b':') else {
            continue;
        };
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(&line[..colon]),
            HeaderValue::from_bytes(&line[colon + 1..]),
        ) else {
            continue;
        };
        req = req.header(name, value);
    }
    let Ok(req) = req.body(()) else {
        return;
    };
    let (req, ()) = req.into_parts();
    let ip = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));

    let key = match spec.extract(&req, ip) {
        Ok(key) => key,
        Err(missing) => {
            assert!(spec.parts.contains(missing.part()));
            return;
        }
    };
    assert!(!key.value.is_empty());
    let values: Vec<&str> = match spec.parts.len() {
        1 => vec![key.value.as_ref()],
        _ => key.parts.iter().map(String::as_str).collect(),
    };
    assert_eq!(values.len(), spec.parts.len());
    for (part, value) in spec.parts.iter().zip(&values) {
        assert!(!value.is_empty(), "{part:?} is empty");
        if !matches!(part, KeyPart::Ip | KeyPart::Global) {
            assert!(
                spec.any_value(&req, ip, |v| v == *value),
                "the deny list does not see {value:?} of {part:?}"
            );
        }
    }
    if spec.parts.len() > 1 {
        assert_eq!(split_key(&key.value), key.parts, "{:?}", key.value);
    }
    let stored = ClientKey::new(key.value.clone());
    let stored = stored.stored();
    assert!(stored.len() <= crate::identity::MAX_STORED_KEY.max(41));
    assert!(!stored.contains(['{', '}']));
}

/// A bearer token (after `jwt `, its bytes as they came), checked at a fixed time by
/// a provider with the HS secret `fuzz-secret` and by one with a JWKS (the test RSA
/// key, kid `r1`, and an EC key), then read by `jwt:sub` and `jwt:/org/id` keys:
/// malformed base64, huge headers, deep or odd JSON.
///
/// - Nothing panics.
/// - A token the HS provider accepts carries an HMAC of its first two parts under
///   that secret, computed here with ring: no unsigned or forged token becomes claims.
/// - A token the JWKS provider accepts names a public-key algorithm (never `none`,
///   never HS).
/// - Checking it again (now from the cache) gives the same answer.
/// - A claim key of accepted claims is non-empty, and the deny list sees it.
pub fn key_token(data: &[u8]) {
    use crate::identity::{Claim, VerifiedClaims};
    use crate::jwt::{Provider, ProviderSpec, Source};
    use base64::Engine;
    use std::sync::OnceLock;
    const NOW: u64 = 1_800_000_000;
    const SECRET: &[u8] = b"fuzz-secret";
    let spec = |source| ProviderSpec {
        name: "fuzz".into(),
        source,
        issuer: None,
        audiences: Vec::new(),
        leeway: std::time::Duration::from_secs(60),
        cache_size: 64,
    };
    static HS: OnceLock<Provider> = OnceLock::new();
    static PUBLIC: OnceLock<Provider> = OnceLock::new();
    let hs = HS.get_or_init(|| {
        Provider::new(spec(Source::Secret(SECRET.to_vec()))).expect("an HS provider")
    });
    let public = PUBLIC.get_or_init(|| {
        use crate::jwt::testing::{jwks, TestKey};
        let doc = jwks(&[&TestKey::rsa("r1"), &TestKey::ec("e1")]);
        let keys = crate::jwt::KeySet::parse_jwks(doc.as_bytes()).expect("the JWKS");
        Provider::with_keys(spec(Source::Url("http://127.0.0.1:9/".into())), keys)
    });
    let token = String::from_utf8_lossy(data);
    for (p, is_hs) in [(hs, true), (public, false)] {
        let first = p.check(&token, NOW);
        let again = p.check(&token, NOW);
        assert_eq!(
            first.as_ref().map(|c| c.0.clone()).map_err(|f| *f),
            again.as_ref().map(|c| c.0.clone()).map_err(|f| *f),
            "the cache answers as the check did"
        );
        let Ok(claims) = first else { continue };
        let alg = crate::jwt::header(&token)
            .expect("an accepted token's header")
            .alg;
        if is_hs {
            let h = match alg {
                jsonwebtoken::Algorithm::HS256 => ring::hmac::HMAC_SHA256,
                jsonwebtoken::Algorithm::HS384 => ring::hmac::HMAC_SHA384,
                jsonwebtoken::Algorithm::HS512 => ring::hmac::HMAC_SHA512,
                other => panic!("the HS provider accepted {other:?}"),
            };
            let (message, signature) = token.rsplit_once('.').expect("three parts");
            let signature = base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(signature)
                .expect("an accepted signature is base64url");
            let key = ring::hmac::Key::new(h, SECRET);
            assert!(
                ring::hmac::verify(&key, message.as_bytes(), &signature).is_ok(),
                "accepted without the secret's HMAC"
            );
        } else {
            assert!(
                alg.family() != jsonwebtoken::AlgorithmFamily::Hmac,
                "the JWKS provider accepted {alg:?}"
            );
        }
        let mut req = Request::new(()).into_parts().0;
        req.extensions.insert(VerifiedClaims(claims.0.clone()));
        let ip = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));
        for claim in ["sub", "/org/id"] {
            let part = KeyPart::Jwt(Claim::parse(claim).expect("a claim"));
            let spec = KeySpec::new(vec![part]);
            if let Ok(key) = spec.extract(&req, ip) {
                assert!(!key.value.is_empty());
                assert!(spec.any_value(&req, ip, |v| v == key.value));
            }
        }
    }
}

/// One value `v` of the field `user`, spelled every way PHP, Go or Python read as
/// that field with that value: a form (its name cut at a NUL, escaped, an array), a
/// multipart part, JSON (member names in other cases, `ſ` for `s`, a byte order
/// mark), and the value composed, decomposed and (on a normalising key) in other
/// cases. Input: `none|casefold|email`, a space, the value.
///
/// - Every spelling that gives a key gives the same key: no spelling buys a fresh
///   budget.
/// - For every spelling, the deny list sees that key (`any_value`): no spelling
///   passes a deny entry of it, even where the key is missing (a repeat).
pub fn key_spellings(data: &[u8]) {
    use crate::identity::Normalize;
    use unicode_normalization::UnicodeNormalization;
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (form, v) = text.split_once(' ').unwrap_or(("none", text));
    // Line breaks would frame a multipart body otherwise; no key holds a control
    // character anyway.
    if v.chars().any(char::is_control) {
        return;
    }
    let normalize = match form {
        "casefold" => Normalize::Casefold,
        "email" => Normalize::Email,
        _ => Normalize::None,
    };
    let mut values: Vec<String> = vec![v.to_string(), v.nfc().collect(), v.nfd().collect()];
    if normalize != Normalize::None {
        values.extend([v.to_uppercase(), v.to_lowercase()]);
    }
    let pct = |s: &str| {
        percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
    };
    let json = |s: &str| serde_json::to_string(s).unwrap_or_default();
    let mut bodies: Vec<(&str, &str, Vec<u8>)> = Vec::new();
    const MP: &str = "multipart/form-data; boundary=XyZ";
    for v in &values {
        for name in ["user", "user%00", "us%65r", "user[]", "user%00x"] {
            let body = format!("{name}={}", pct(v));
            bodies.push((
                "form:user",
                "application/x-www-form-urlencoded",
                body.into_bytes(),
            ));
        }
        for name in ["\"user\"", "user", "\"user\0\""] {
            let body = format!(
                "--XyZ\r\nContent-Disposition: form-data; name={name}\r\n\r\n{v}\r\n--XyZ--\r\n"
            );
            bodies.push(("form:user", MP, body.into_bytes()));
        }
        for name in ["user", "USER", "uſer", "\\u0075ser"] {
            let body = format!("{{\"{name}\": {}}}", json(v));
            bodies.push(("json:/user", "application/json", body.clone().into_bytes()));
            bodies.push((
                "json:/user",
                "application/json",
                format!("\u{FEFF}{body}").into_bytes(),
            ));
        }
    }
    let ip = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));
    for spec_text in ["form:user", "json:/user"] {
        let mut spec = KeySpec::new(vec![KeyPart::parse(spec_text).expect("a key part")]);
        spec.normalize = normalize;
        let requests: Vec<(http::request::Parts, &[u8])> = bodies
            .iter()
            .filter(|(s, _, _)| *s == spec_text)
            .filter_map(|(_, ct, body)| {
                let req = Request::post("/")
                    .header("content-type", *ct)
                    .body(())
                    .ok()?;
                Some((req.into_parts().0, body.as_slice()))
            })
            .collect();
        let keys: std::collections::BTreeSet<String> = requests
            .iter()
            .filter_map(|(p, body)| spec.extract_with_body(p, ip, Some(body)).ok())
            .map(|k| k.value.into_owned())
            .collect();
        assert!(keys.len() <= 1, "{spec_text} ({form}): one value, {keys:?}");
        let Some(key) = keys.first() else {
            continue;
        };
        for (p, body) in &requests {
            assert!(
                spec.any_value_with_body(p, ip, Some(body), |x| x == key),
                "{spec_text} ({form}): the deny list does not see {key:?} in {:?}",
                String::from_utf8_lossy(body)
            );
        }
    }
}

/// A request path through `path::normalize` and `route_view`.
///
/// - A normalised path starts with `/`, has no empty, `.` or `..` segment and no
///   escape of an unreserved character, `/`, `\\` or NUL.
/// - Normalising is idempotent: the normal form is its own normal form, and is
///   returned as it is (no allocation).
/// - What routes see (`route_view`) is normal too and has no `;parameters`.
pub fn path(data: &[u8]) {
    let Ok(raw) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(normal) = crate::pipeline::path::normalize(raw) else {
        return;
    };
    assert!(normal.starts_with('/'), "{raw:?} -> {normal:?}");
    let again = crate::pipeline::path::normalize(&normal)
        .unwrap_or_else(|e| panic!("{raw:?} -> {normal:?} -> {e}"));
    assert!(
        matches!(again, std::borrow::Cow::Borrowed(_)) && again == normal,
        "{raw:?} -> {normal:?} -> {again:?}"
    );
    let segments: Vec<&str> = normal[1..].split('/').collect();
    for (i, s) in segments.iter().enumerate() {
        let last = i + 1 == segments.len();
        assert!(!s.is_empty() || last, "{raw:?} -> {normal:?}");
        assert!(!matches!(*s, "." | ".."), "{raw:?} -> {normal:?}");
    }
    assert!(!normal.contains('\\'), "{raw:?} -> {normal:?}");
    for (i, _) in normal.match_indices('%') {
        let hex = normal.get(i + 1..i + 3).unwrap_or_default();
        let byte = (hex.len() == 2 && hex.bytes().all(|h| h.is_ascii_hexdigit()))
            .then(|| u8::from_str_radix(hex, 16).ok())
            .flatten();
        let kept = |b: u8| {
            let lower_hex = hex.bytes().any(|h| h.is_ascii_lowercase());
            !(b.is_ascii_alphanumeric() || b"-._~/\\\0".contains(&b) || lower_hex)
        };
        assert!(byte.is_some_and(kept), "{raw:?} -> {normal:?}");
    }
    let view = crate::pipeline::path::route_view(&normal);
    assert!(!view.contains(';'), "{raw:?} -> {view:?}");
    assert_eq!(
        crate::pipeline::path::normalize(&view).as_deref(),
        Ok(&*view),
        "{raw:?} -> {normal:?} -> {view:?}"
    );
    assert_eq!(crate::pipeline::path::route_view(&view), view);
}

/// A composite key's parts: split on `|`, with `\` escaping the next character.
fn split_key(k: &str) -> Vec<String> {
    let mut parts = vec![String::new()];
    let mut chars = k.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => parts.last_mut().unwrap().extend(chars.next()),
            '|' => parts.push(String::new()),
            c => parts.last_mut().unwrap().push(c),
        }
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readable_inputs() {
        config(b"routes:\n  - name: api\n    respond: {status: 200}\n    limits:\n      - {algorithm: gcra, rate: 10/s}\n");
        duration_rate(b"5/10s");
        client_ip(b"10.0.0.0/8\n10.0.0.2\n6.6.6.6, 203.0.113.7\n10.1.1.1");
        key(b"header:x-api-key cookie:s\n/?k=1\nx-api-key: a|b\ncookie: s=c\\d");
        path(b"/x/../%6Cogin;a/.");
    }
}
