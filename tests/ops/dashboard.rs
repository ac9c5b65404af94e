//! The dashboard at `GET /` of the admin listener, and the JSON it reads: the
//! stats endpoint's exact counts, its token, the page's headers, and the whole page
//! in a real headless Chromium (over WebDriver) against the `sluice` binary: sign in
//! with the token, watch a route's counters move, deny a key through the page's
//! form, see the next request refused, remove the entry, see it pass again.

use crate::common;
use crate::common::redis::SluiceProcess;
use crate::common::webdriver;
use crate::common::*;
use http::Method;
use serde_json::{json, Value};

const TOKEN: &str = "dash-s3cret";
/// A deny reason that would run script if the page ever used it as markup.
const HOSTILE: &str = "<img src=x onerror=\"window.__xss=1\"> & <b>bold</b>";

fn rules(upstream: &str) -> String {
    format!(
        r#"
upstreams:
  app: {{targets: ["{upstream}"]}}
routes:
  - name: api
    match: {{path_prefix: /api/}}
    upstream: app
    key: header:x-api-key
    limits:
      - {{name: burst, algorithm: token_bucket, rate: 1/h, burst: 3}}
      - {{algorithm: fixed_window, limit: 1000, window: 1d}}
  - name: health
    match: {{path: /ping}}
    respond: {{status: 200, body: "pong\n"}}
"#
    )
}

fn bearer() -> (&'static str, String) {
    ("authorization", format!("Bearer {TOKEN}"))
}

async fn stats(admin: std::net::SocketAddr) -> Value {
    let (k, v) = bearer();
    let r = get(&url(admin, "/admin/stats"), &[(k, &v)]).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("application/json"));
    serde_json::from_slice(&r.body).expect("JSON")
}

/// Each route card's chart: for each of its lines, whether any point is above the
/// baseline; `null` for a line that is missing or has no points.
const CHART_LINES: &str = r#"
const out = {};
for (const card of document.querySelectorAll('.route')) {
  const lines = {};
  for (const k of ['allowed', 'limited', 'denied', 'other']) {
    const l = card.querySelector(`svg.chart polyline.line.${k}`);
    const pts = l ? (l.getAttribute('points') || '').trim().split(/\s+/).filter(Boolean)
      .map(p => p.split(',').map(Number)) : [];
    const ok = pts.length > 0 && pts.every(p => p.length === 2 && p.every(Number.isFinite));
    lines[k] = ok ? pts.some(p => p[1] < 76) : null;
  }
  out[card.dataset.route] = lines;
}
return out;
"#;

/// Writes the screenshot as `dir/dashboard.png`, creating `dir` if need be.
fn save_screenshot(dir: &std::path::Path, png: &[u8]) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    let path = dir.join("dashboard.png");
    std::fs::write(&path, png).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    path
}

/// The screenshot goes under `target/` even in a fresh clone built elsewhere
/// (`CARGO_TARGET_DIR`), where there is no `target/` yet.
#[test]
fn the_screenshot_is_saved_where_no_directory_exists_yet() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = tmp.path().join("target");
    let path = save_screenshot(&dir, b"\x89PNG");
    assert_eq!(std::fs::read(&path).expect("read back"), b"\x89PNG");
}

/// In process, with a token: 3 allowed, 2 limited, 1 unmatched.
async fn gateway_with_traffic() -> (Running, Upstream) {
    let up = upstream().await;
    let gw = start_gateway(&format!(
        "admin: {{listen: \"127.0.0.1:0\", token: {TOKEN}}}\n{}",
        rules(&up.url())
    ))
    .await;
    let c = http1();
    let got = statuses(&c, 5, &url(gw.addr, "/api/x"), &[("x-api-key", "alice")]).await;
    assert_eq!(got, ok_then_limited(3, 2));
    assert_eq!(c.get(&url(gw.addr, "/nowhere"), &[]).await.status, 404);
    (gw, up)
}

#[tokio::test]
async fn stats_shows_each_routes_exact_counts_the_store_and_the_reload() {
    let (gw, _up) = gateway_with_traffic().await;
    let s = stats(gw.admin_addr).await;

    let api = &s["routes"][0];
    assert_eq!(api["name"], "api");
    assert_eq!(
        api["totals"],
        json!({"allowed": 3, "delayed": 0, "limited": 2, "denied": 0, "shadow": 0,
               "store_error_allowed": 0, "store_error_denied": 0, "bad_request": 0,
               "unauthorized": 0})
    );
    assert_eq!(s["routes"][1]["name"], "health");
    assert_eq!(s["routes"].as_array().map(Vec::len), Some(2));
    assert_eq!(
        s["unmatched"]["totals"],
        json!({"denied": 0, "unmatched": 1, "bad_request": 0})
    );
    assert_eq!(
        s["store"],
        json!({"backend": "memory", "ready": true, "errors": 0, "on_error": "local"})
    );
    assert_eq!((&s["ready"], &s["not_ready"]), (&json!(true), &json!([])));
    assert_eq!(s["config"]["last_reload"], Value::Null);
    assert_eq!(s["config"]["reloads"], json!({"success": 0, "failure": 0}));
    assert_eq!(s["config"]["hash"].as_str().map(str::len), Some(40));
    assert_eq!(s["deny_entries"], json!({"static": 0, "api": 0, "ban": 0}));
    assert_eq!(s["sample_every_ms"], 2000);
    assert_eq!(s["keep_ms"], 300_000);
    assert_eq!(s["version"], env!("CARGO_PKG_VERSION"));

    // The sampler took its first sample at startup, before any traffic: one column
    // per decision, as long as the times.
    let h = &api["history"];
    let n = h["at_ms"].as_array().map(Vec::len).unwrap_or(0);
    assert!(n >= 1, "no sample yet: {h}");
    for d in [
        "allowed",
        "delayed",
        "limited",
        "denied",
        "shadow",
        "store_error_allowed",
        "store_error_denied",
        "bad_request",
    ] {
        assert_eq!(h[d].as_array().map(Vec::len), Some(n), "{d}: {h}");
    }
    assert_eq!(h["allowed"][0], 0, "{h}");
    assert!(h["at_ms"][0].as_u64() <= s["now_ms"].as_u64());
    gw.shutdown().await;
}

#[tokio::test]
async fn the_admin_json_needs_the_token_and_the_page_does_not() {
    let (gw, _up) = gateway_with_traffic().await;
    let stats_url = url(gw.admin_addr, "/admin/stats");
    for headers in [
        vec![],
        vec![("authorization", "Bearer wrong")],
        vec![("authorization", TOKEN)],
    ] {
        let r = get(&stats_url, &headers).await;
        assert_eq!(r.status, 401, "{headers:?}");
        assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    }
    let r = http1()
        .send(
            Method::POST,
            &stats_url,
            &[("authorization", &format!("Bearer {TOKEN}"))],
            "",
        )
        .await;
    assert_eq!(r.status, 405);
    assert_eq!(r.header("allow"), Some("GET"));

    let csp = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
               base-uri 'none'; form-action 'none'; frame-ancestors 'none'";
    for (path, kind) in [
        ("/", "text/html; charset=utf-8"),
        ("/dashboard.js", "text/javascript; charset=utf-8"),
        ("/dashboard.css", "text/css; charset=utf-8"),
    ] {
        let r = get(&url(gw.admin_addr, path), &[]).await;
        assert_eq!(r.status, 200, "{path}");
        assert_eq!(r.header("content-type"), Some(kind), "{path}");
        assert_eq!(r.header("cache-control"), Some("no-store"), "{path}");
        assert_eq!(r.header("content-security-policy"), Some(csp), "{path}");
        assert_eq!(r.header("x-content-type-options"), Some("nosniff"));
        assert_eq!(r.header("x-frame-options"), Some("DENY"));
        assert_eq!(r.header("referrer-policy"), Some("no-referrer"));
    }
    let page = get(&url(gw.admin_addr, "/"), &[]).await;
    assert!(page
        .text()
        .contains("<script src=\"/dashboard.js\" defer></script>"));
    gw.shutdown().await;
}

#[tokio::test]
async fn without_a_token_configured_the_stats_need_none() {
    let up = upstream().await;
    let gw = start_gateway(&rules(&up.url())).await;
    let r = get(&url(gw.admin_addr, "/admin/stats"), &[]).await;
    assert_eq!(r.status, 200);
    let s: Value = serde_json::from_slice(&r.body).expect("JSON");
    assert_eq!(s["routes"][0]["totals"]["allowed"], 0);
    gw.shutdown().await;
}

#[tokio::test]
async fn a_failed_reload_shows_in_stats_and_a_kept_route_keeps_its_history() {
    let up = upstream().await;
    let yaml = format!(
        "admin: {{listen: \"127.0.0.1:0\", token: {TOKEN}}}\n{}",
        rules(&up.url())
    );
    let (gw, file) = start_gateway_file(&yaml).await;
    let first = stats(gw.admin_addr).await;
    let t0 = first["routes"][0]["history"]["at_ms"][0].clone();
    assert!(t0.is_u64(), "{first}");

    std::fs::write(file.path(), with_listeners("routes: [oops\n")).expect("write");
    let err = gw.reload().await.expect_err("a broken file does not load");
    let s = stats(gw.admin_addr).await;
    let last = &s["config"]["last_reload"];
    assert_eq!(last["result"], "failure", "{s}");
    assert_eq!(last["trigger"], "signal");
    assert_eq!(last["error"], err.as_str());
    assert_eq!(last["hash"], Value::Null);
    assert_eq!(s["config"]["reloads"], json!({"success": 0, "failure": 1}));
    assert_eq!(s["config"]["hash"], first["config"]["hash"]);

    // `health` renamed to `ping`, `api` kept.
    std::fs::write(
        file.path(),
        with_listeners(&yaml.replace("name: health", "name: ping")),
    )
    .expect("write");
    let hash = gw.reload().await.expect("the renamed route loads");
    let s = stats(gw.admin_addr).await;
    assert_eq!(s["config"]["last_reload"]["result"], "success");
    assert_eq!(s["config"]["last_reload"]["hash"], hash.as_str());
    assert_eq!(s["config"]["reloads"], json!({"success": 1, "failure": 1}));
    // The next sample keeps `api`'s history and starts `ping`'s.
    let sampled = eventually(BOUND, || async {
        let s = stats(gw.admin_addr).await;
        s["routes"][1]["history"]["at_ms"]
            .as_array()
            .is_some_and(|a| !a.is_empty())
    })
    .await;
    assert!(sampled.is_some(), "no sample of the new route");
    let s = stats(gw.admin_addr).await;
    assert_eq!(s["routes"][1]["name"], "ping");
    assert_eq!(s["routes"][0]["history"]["at_ms"][0], t0, "{s}");
    gw.shutdown().await;
}

/// The whole page in Chromium against the binary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_in_chromium_shows_counts_and_denies_and_allows_a_key() {
    let up = upstream().await;
    let sluice = SluiceProcess::start_admin(&format!("token: {TOKEN}"), &rules(&up.url())).await;
    let browser = webdriver::Browser::start().await;
    let page = url(sluice.admin, "/");
    browser.open(&page).await;

    // It asks for the token, and only then shows the routes.
    browser
        .wait_for(
            "the token form",
            "return document.getElementById('login').hidden",
            json!(false),
        )
        .await;
    assert_eq!(
        browser
            .eval("return document.getElementById('app').hidden")
            .await,
        json!(true)
    );
    // A wrong token is refused and asked for again.
    let field = browser.find("#token").await;
    browser.type_into(&field, "wrong").await;
    browser.click(&browser.find("#login-button").await).await;
    browser
        .wait_for(
            "the refusal of a wrong token",
            "return document.getElementById('login-error').textContent",
            json!("That token was refused."),
        )
        .await;
    assert_eq!(
        browser
            .eval("return document.getElementById('app').hidden")
            .await,
        json!(true)
    );
    browser.type_into(&field, TOKEN).await;
    browser.click(&browser.find("#login-button").await).await;
    browser
        .wait_for(
            "the app after signing in",
            "return document.getElementById('app').hidden",
            json!(false),
        )
        .await;
    // Kept for this tab only, never in the URL.
    assert_eq!(
        browser
            .eval("return [sessionStorage.getItem('sluice-admin-token'), localStorage.length, location.href]")
            .await,
        json!([TOKEN, 0, page])
    );

    // The route and its limits.
    let count = |route: &str, decision: &str| {
        format!(
            "const e = document.querySelector('.route[data-route=\"{route}\"] .counter[data-decision=\"{decision}\"] .n'); return e ? e.textContent : null"
        )
    };
    browser
        .wait_for(
            "api's allowed counter",
            &count("api", "allowed"),
            json!("0"),
        )
        .await;
    let limits = browser
        .eval("return [...document.querySelectorAll('.route[data-route=\"api\"] .limits li')].map(e => e.textContent)")
        .await;
    assert_eq!(
        limits,
        json!([
            "burst token_bucket rate 1/h, burst 3",
            "fixed_window_1 fixed_window limit 1000, per 1d"
        ])
    );
    let store = browser.text(&browser.find("#store").await).await;
    assert!(
        store.contains("memory") && store.contains("answers") && !store.contains("not ready"),
        "{store}"
    );
    let config = browser.text(&browser.find("#config").await).await;
    assert!(config.contains("none since start"), "{config}");

    // Traffic moves the counters to the exact numbers.
    let c = http1();
    let api = url(sluice.addr, "/api/x");
    let got = statuses(&c, 5, &api, &[("x-api-key", "alice")]).await;
    assert_eq!(got, ok_then_limited(3, 2));
    browser
        .wait_for(
            "allowed after traffic",
            &count("api", "allowed"),
            json!("3"),
        )
        .await;
    browser
        .wait_for(
            "limited after traffic",
            &count("api", "limited"),
            json!("2"),
        )
        .await;
    assert_eq!(browser.eval(&count("api", "denied")).await, json!("0"));
    // Every route's chart plots its four series, and api's allowed and limited lines
    // leave the baseline (y 76 of the 90-high chart) where the traffic was.
    browser
        .wait_for(
            "the plotted series of every route",
            CHART_LINES,
            json!({
                "api": {"allowed": true, "limited": true, "denied": false, "other": false},
                "health": {"allowed": false, "limited": false, "denied": false, "other": false},
            }),
        )
        .await;

    // Deny `mallory` through the form, with a reason full of markup.
    browser
        .type_into(&browser.find("#deny-value").await, "mallory")
        .await;
    browser
        .type_into(&browser.find("#deny-ttl").await, "10m")
        .await;
    browser
        .type_into(&browser.find("#deny-reason").await, HOSTILE)
        .await;
    browser.click(&browser.find("#deny-add").await).await;
    let row = "tr[data-kind=\"key\"][data-value=\"mallory\"]";
    browser
        .wait_for(
            "the new deny entry",
            &format!("const r = document.querySelector('{row}'); return r ? r.querySelector('.reason').textContent : null"),
            json!(HOSTILE),
        )
        .await;
    // Shown as text: no element came out of it, and nothing ran.
    assert_eq!(
        browser
            .eval(&format!("return [document.querySelector('{row} .reason').childElementCount, document.querySelectorAll('img').length, window.__xss === undefined]"))
            .await,
        json!([0, 0, true])
    );
    let (k, v) = bearer();
    let listed = get(&url(sluice.admin, "/admin/deny"), &[(k, &v)]).await;
    let listed: Value = serde_json::from_slice(&listed.body).expect("JSON");
    assert_eq!(listed[0]["value"], "mallory", "{listed}");
    assert_eq!(listed[0]["reason"], HOSTILE);
    assert_eq!(listed[0]["source"], "api");
    assert!(listed[0]["expires_at"].is_string());

    let refused = c.get(&api, &[("x-api-key", "mallory")]).await;
    assert_eq!(refused.status, 403);
    browser
        .wait_for(
            "denied after the refusal",
            &count("api", "denied"),
            json!("1"),
        )
        .await;

    let shot = browser.screenshot().await;
    assert_eq!(&shot[..8], b"\x89PNG\r\n\x1a\n");
    let path = save_screenshot(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target"),
        &shot,
    );
    println!("dashboard screenshot: {}", path.display());

    // Remove it through the page: the key passes again.
    browser
        .click(&browser.find(&format!("{row} button.remove")).await)
        .await;
    browser
        .wait_for(
            "the entry gone",
            &format!("return document.querySelector('{row}') === null"),
            json!(true),
        )
        .await;
    let passed = c.get(&api, &[("x-api-key", "mallory")]).await;
    assert_eq!(passed.status, 200);
    browser
        .wait_for(
            "allowed after removal",
            &count("api", "allowed"),
            json!("4"),
        )
        .await;
    assert_eq!(up.hits(), 4);

    browser.quit().await;
    drop(sluice);
}

/// With no token configured the page opens at once, and its form works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_in_chromium_needs_no_token_when_none_is_configured() {
    let up = upstream().await;
    let sluice = SluiceProcess::start(&[], &[], &rules(&up.url())).await;
    let browser = webdriver::Browser::start().await;
    browser.open(&url(sluice.admin, "/")).await;
    browser
        .wait_for(
            "the routes without signing in",
            "return [...document.querySelectorAll('.route h3')].map(e => e.textContent)",
            json!(["api", "health"]),
        )
        .await;
    assert_eq!(
        browser
            .eval("return [document.getElementById('login').hidden, document.getElementById('forget').hidden]")
            .await,
        json!([true, true])
    );
    // A bad entry is refused with the API's message, shown as text.
    browser
        .click(&browser.find("#deny-kind option[value=\"ip\"]").await)
        .await;
    browser
        .type_into(&browser.find("#deny-value").await, "300.1.2.3")
        .await;
    browser.click(&browser.find("#deny-add").await).await;
    browser
        .wait_for(
            "the API's refusal",
            "return document.getElementById('deny-message').textContent",
            json!("400: ip \"300.1.2.3\" is not an address or CIDR block like 203.0.113.7 or 10.1.0.0/16"),
        )
        .await;
    let r = get(&url(sluice.admin, "/admin/deny"), &[]).await;
    assert_eq!(r.text(), "[]\n");
    browser.quit().await;
}

/// On the Redis store: its health as `/readyz` sees it, and its failed calls as
/// `sluice_store_errors_total` counts them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_shows_the_redis_store_going_down() {
    let mut redis = common::redis::RedisServer::start();
    let up = upstream().await;
    let store = common::redis::redis_store(&common::redis::url_target(&redis.url()), "deny", 2000);
    let gw = start_gateway(&format!(
        "admin: {{listen: \"127.0.0.1:0\", token: {TOKEN}}}\n{store}{}",
        rules(&up.url())
    ))
    .await;
    let c = http1();
    let api = url(gw.addr, "/api/x");
    assert_eq!(c.get(&api, &[("x-api-key", "k")]).await.status, 200);
    let s = stats(gw.admin_addr).await;
    assert_eq!(
        s["store"],
        json!({"backend": "redis", "ready": true, "errors": 0, "on_error": "deny"})
    );
    assert_eq!((&s["ready"], &s["not_ready"]), (&json!(true), &json!([])));

    redis.kill();
    assert_eq!(c.get(&api, &[("x-api-key", "k")]).await.status, 503);
    let down = eventually(BOUND, || async {
        stats(gw.admin_addr).await["store"]["ready"] == json!(false)
    })
    .await;
    assert!(down.is_some(), "the store never showed as down");
    let s = stats(gw.admin_addr).await;
    // `ready` is /readyz's answer, and `not_ready` says why (as /readyz does).
    assert_eq!(
        (&s["ready"], &s["not_ready"]),
        (&json!(false), &json!(["store unavailable"]))
    );
    let r = get(&url(gw.admin_addr, "/readyz"), &[]).await;
    assert_eq!((r.status, r.text()), (503, "store unavailable\n"));
    let counted = metric(
        &metrics(gw.admin_addr).await,
        "sluice_store_errors_total{store=\"redis\"}",
    );
    assert!(s["store"]["errors"].as_u64() >= Some(1), "{s}");
    assert_eq!(s["store"]["errors"].as_f64(), counted);
    assert_eq!(s["routes"][0]["totals"]["allowed"], 1);
    assert_eq!(s["routes"][0]["totals"]["store_error_denied"], 1);
    gw.shutdown().await;
}

/// A Redis that was never reachable: the store is down and the shared deny list was
/// never read; `/readyz` says the first, stats both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_says_everything_that_is_not_ready() {
    let up = upstream().await;
    let nowhere = format!("redis://127.0.0.1:{}", free_port());
    let store = common::redis::redis_store(&common::redis::url_target(&nowhere), "local", 200);
    let gw = start_gateway(&format!(
        "admin: {{listen: \"127.0.0.1:0\", token: {TOKEN}}}\n{store}{}",
        rules(&up.url())
    ))
    .await;
    let s = stats(gw.admin_addr).await;
    assert_eq!(s["store"]["ready"], false, "{s}");
    assert_eq!(
        (&s["ready"], &s["not_ready"]),
        (
            &json!(false),
            &json!(["store unavailable", "shared deny list not read yet"])
        )
    );
    // `on_error: local` decides alone, with the whole limit: no other instance was
    // ever seen.
    let alone = "Redis unreachable; on_error local enforces every limit in this instance alone (no other live instance was seen)";
    assert_eq!(s["store"]["degraded"], alone, "{s}");
    let r = get(&url(gw.admin_addr, "/readyz"), &[]).await;
    assert_eq!(
        (r.status, r.text()),
        (
            503,
            format!("store unavailable\ndegraded: {alone}\n").as_str()
        )
    );
    gw.shutdown().await;
}

/// A long deny list is shown a page at a time (100 entries), with where the page
/// stands in the whole, and Next and Previous.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_pages_a_long_deny_list() {
    let up = upstream().await;
    let sluice = SluiceProcess::start(&[], &[], &rules(&up.url())).await;
    for i in 0..130 {
        let body = format!(r#"{{"key":"k{i:03}"}}"#);
        let r = common::redis::request(sluice.admin, "POST", "/admin/deny", &[], &body).await;
        assert_eq!(r.status, 201, "{}", r.body);
    }
    let browser = webdriver::Browser::start().await;
    browser.open(&url(sluice.admin, "/")).await;
    const SHOWN: &str = "const rows = [...document.querySelectorAll('#deny tr')]; return [document.getElementById('deny-count').textContent, rows.length, rows[0]?.dataset.value ?? null, rows[rows.length - 1]?.dataset.value ?? null, document.getElementById('deny-prev').hidden, document.getElementById('deny-next').hidden]";
    let first = json!(["1–100 of 130 entries", 100, "k000", "k099", true, false]);
    browser
        .wait_for("the first page", SHOWN, first.clone())
        .await;
    browser.click(&browser.find("#deny-next").await).await;
    browser
        .wait_for(
            "the second page",
            SHOWN,
            json!(["101–130 of 130 entries", 30, "k100", "k129", false, true]),
        )
        .await;
    browser.click(&browser.find("#deny-prev").await).await;
    browser.wait_for("the first page again", SHOWN, first).await;
    browser.quit().await;
}

/// Writes `png` as `dir/name`, creating `dir` if need be.
fn save_named(dir: &std::path::Path, name: &str, png: &[u8]) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    let path = dir.join(name);
    std::fs::write(&path, png).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    path
}

/// The walk-through of docs/finding-abusers.md in Chromium: two instances of
/// `docs/examples/abusers.yaml` on one Redis; the page of one shows the fleet (both
/// instances, one hash, summed counts), each route's upstream statuses (a 5xx
/// marked), which limit refused, its top offenders (a hostile key as text), denies
/// the scraper with one click (the other instance refuses it), and puts a failed
/// reload, a fleet with two configurations and a store gone (degraded: limits
/// divided by the two instances) across the page. Times
/// are UTC and say so. Screenshots: `target/dashboard-abusers.png`,
/// `target/dashboard-banners.png`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_in_chromium_finds_and_denies_an_abuser_across_a_fleet() {
    let mut redis = common::redis::RedisServer::start();
    let up = upstream().await;
    let example = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/examples/abusers.yaml"),
    )
    .unwrap();
    let yaml = example.replace("http://127.0.0.1:3000", &up.url());
    let env = [("REDIS_URL", redis.url())];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let a = SluiceProcess::start_env(&yaml, &env).await;
    let b = SluiceProcess::start_env(&yaml, &env).await;
    let c = http1();

    // Failed logins through a first: 5 of the upstream's 401s, then 3 refusals.
    let mut logins = Vec::new();
    for _ in 0..8 {
        let h = [
            ("content-type", "application/x-www-form-urlencoded"),
            ("x-reply-status", "401"),
        ];
        let r = c
            .send(
                Method::POST,
                &url(a.addr, "/login"),
                &h,
                "user=alice&password=guess",
            )
            .await;
        logins.push(r.status);
    }
    assert_eq!(logins, [401, 401, 401, 401, 401, 429, 429, 429]);
    // The scraper through both: 20 a minute between them, the rest refused. (The
    // page's refresh is no request of the gateway's.)
    let scraper = [("x-api-key", "scraper-7")];
    let mut admitted = 0;
    for _ in 0..30 {
        for gw in [&a, &b] {
            admitted +=
                usize::from(c.get(&url(gw.addr, "/api/items"), &scraper).await.status == 200);
        }
    }
    assert!(admitted <= 20, "{admitted}");
    // A hostile key refused twice through a, and one 503 from the upstream.
    for _ in 0..22 {
        c.get(&url(a.addr, "/api/items"), &[("x-api-key", HOSTILE)])
            .await;
    }
    let r = c
        .get(
            &url(a.addr, "/api/items"),
            &[("x-api-key", "user-1"), ("x-reply-status", "503")],
        )
        .await;
    assert_eq!(r.status, 503);

    let browser = webdriver::Browser::start().await;
    browser.open(&url(a.admin, "/")).await;
    let route_text = |route: &str, css: &str| {
        format!("const e = document.querySelector('.route[data-route=\"{route}\"] {css}'); return e ? e.textContent : null")
    };
    // The fleet: both instances, one configuration, the counts summed.
    browser
        .wait_for(
            "both instances in the fleet card",
            "return document.querySelectorAll('#fleet tr').length",
            json!(2),
        )
        .await;
    // Once b's heartbeat carries all of its requests: 60 scraper requests, 22
    // hostile, one 503, each admitted or refused.
    let mut fleet = Value::Null;
    let mut counted = 0;
    for _ in 0..(BOUND.as_millis() / 50) {
        let body = get(&url(a.admin, "/admin/fleet"), &[]).await.body;
        fleet = serde_json::from_slice(&body).unwrap();
        let api = &fleet["routes"]["api"];
        counted = api["allowed"].as_u64().unwrap() + api["limited"].as_u64().unwrap();
        if counted == 83 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(counted, 83, "{fleet}");
    let api = &fleet["routes"]["api"];
    let (allowed, limited) = (
        api["allowed"].as_u64().unwrap(),
        api["limited"].as_u64().unwrap(),
    );
    browser
        .wait_for(
            "the fleet's sums",
            "const e = document.querySelector('.fleet-route[data-route=\"api\"]'); return e ? e.textContent : null",
            json!(format!("api allowed {allowed} · limited {limited} · denied 0")),
        )
        .await;
    assert_eq!(
        browser.eval("return [...document.querySelectorAll('#fleet tr td:nth-child(4) code')].map(e => e.textContent)").await,
        json!([fleet["instances"][0]["config_hash"].as_str().unwrap()[..12], fleet["instances"][1]["config_hash"].as_str().unwrap()[..12]])
    );
    // Each instance beside the sums: its own decisions over its routes.
    let own: Vec<String> = fleet["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            let sum = |d: &str| -> u64 {
                let routes = i["routes"].as_object().unwrap();
                routes.values().map(|c| c[d].as_u64().unwrap_or(0)).sum()
            };
            let (a, l, d) = (sum("allowed"), sum("limited"), sum("denied"));
            format!("allowed {a} · limited {l} · denied {d}")
        })
        .collect();
    assert_eq!(
        own.iter()
            .map(|o| o.split(' ').nth(1).unwrap().parse::<u64>().unwrap())
            .sum::<u64>(),
        allowed + 5,
        "{own:?}"
    );
    browser
        .wait_for(
            "each instance's own decisions",
            "return [...document.querySelectorAll('#fleet td.decisions')].map(e => e.textContent)",
            json!(own),
        )
        .await;
    // The upstream's answers beside the decisions: the 5xx marked, the 401s.
    browser
        .wait_for(
            "api's 5xx",
            &route_text("api", ".status.bad[data-code=\"5xx\"]"),
            json!("5xx 1"),
        )
        .await;
    browser
        .wait_for(
            "login's 4xx",
            &route_text("login", ".status[data-code=\"4xx\"]"),
            json!("4xx 5"),
        )
        .await;
    // Which limit refused.
    browser
        .wait_for(
            "login's failures",
            &route_text("login", ".by-limit li[data-limit=\"failures\"] b"),
            json!("3"),
        )
        .await;
    // Top offenders of the fleet (two live instances): the scraper first, its
    // refusals on a and b summed, its address, the hostile key shown as text.
    let rows = "return [...document.querySelectorAll('.route[data-route=\"api\"] table.top tbody tr')].map(r => [...r.querySelectorAll('td')].slice(0, 4).map(td => td.textContent))";
    let refused_on = |admin| async move {
        let top: Value =
            serde_json::from_slice(&get(&url(admin, "/admin/top?route=api"), &[]).await.body)
                .unwrap();
        assert_eq!(top[0]["key"], "scraper-7", "{top}");
        top[0]["refused"].as_u64().unwrap()
    };
    let summed = refused_on(a.admin).await + refused_on(b.admin).await;
    browser
        .wait_for(
            "api's top offenders, summed over the fleet",
            rows,
            json!([
                ["scraper-7", "127.0.0.1", summed.to_string(), "0"],
                [HOSTILE, "127.0.0.1", "2", "0"]
            ]),
        )
        .await;
    assert_eq!(
        browser
            .eval(&route_text("api", ".offenders .top-scope"))
            .await,
        json!("most refused in the last 1–2 minutes, summed over the fleet's 2 live instances")
    );
    assert_eq!(
        browser.eval("return [document.querySelectorAll('table.top code b, table.top img').length, window.__xss === undefined]").await,
        json!([0, true])
    );
    // Every time on the page is UTC, and says so.
    let status = browser.text(&browser.find("#status").await).await;
    assert!(
        status.starts_with("updated ") && status.ends_with(" UTC"),
        "{status}"
    );
    let ticks = browser
        .eval("return [...document.querySelectorAll('.route[data-route=\"api\"] .tick.end')].map(e => e.textContent)")
        .await;
    for t in ticks.as_array().unwrap() {
        assert!(t.as_str().unwrap().ends_with(" UTC (now)"), "{ticks}");
    }
    let shot = browser.screenshot().await;
    let target = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
    println!(
        "screenshot: {}",
        save_named(&target, "dashboard-abusers.png", &shot).display()
    );

    // A click and its confirmation deny the scraper, for the TTL and with the reason
    // shown; the entry is shared, so b refuses it too.
    let deny_scraper = ".route[data-route=\"api\"] tr[data-key=\"scraper-7\"] button.remove";
    browser.click(&browser.find(deny_scraper).await).await;
    browser.click(&browser.find(deny_scraper).await).await;
    browser
        .wait_for(
            "the deny's message",
            &route_text("api", ".offenders .deny-form span"),
            json!("Denied key scraper-7 for 1h."),
        )
        .await;
    let listed = eventually(BOUND, || async {
        let l: Value =
            serde_json::from_slice(&get(&url(b.admin, "/admin/deny"), &[]).await.body).unwrap();
        l.as_array().unwrap().iter().any(|e| {
            e["value"] == "scraper-7"
                && e["reason"] == "top offender on api"
                && e["expires_at"].is_string()
        })
    })
    .await;
    assert!(listed.is_some(), "b never listed the entry");
    assert_eq!(
        c.get(&url(b.addr, "/api/items"), &scraper).await.status,
        403
    );
    browser
        .wait_for(
            "the entry in the deny list",
            "return document.querySelector('#deny tr[data-value=\"scraper-7\"]') !== null",
            json!(true),
        )
        .await;

    // Banners across the page: a failed reload of a, then b on another
    // configuration, then the store gone.
    std::fs::write(a.config_path(), "routes: [oops\n").unwrap();
    let r = c
        .send(Method::POST, &url(a.admin, "/admin/reload"), &[], "")
        .await;
    assert_eq!(r.status, 422);
    browser
        .wait_for(
            "the failed reload's banner",
            "const b = document.getElementById('banner-reload'); return b ? [b.getAttribute('role'), b.textContent.startsWith('The last reload failed (')] : null",
            json!(["alert", true]),
        )
        .await;
    std::fs::write(b.config_path(), yaml.replace("limit: 20,", "limit: 30,")).unwrap();
    let r = c
        .send(Method::POST, &url(b.admin, "/admin/reload"), &[], "")
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    browser
        .wait_for(
            "the fleet's banner",
            "const b = document.getElementById('banner-fleet'); return b ? b.textContent : null",
            json!("The fleet runs 2 different configurations: an instance has not reloaded (see Fleet)."),
        )
        .await;
    let shot = browser.screenshot().await;
    println!(
        "screenshot: {}",
        save_named(&target, "dashboard-banners.png", &shot).display()
    );
    // A good file again: the reload banner goes.
    std::fs::write(a.config_path(), &yaml).unwrap();
    let r = c
        .send(Method::POST, &url(a.admin, "/admin/reload"), &[], "")
        .await;
    assert_eq!(r.status, 200);
    browser
        .wait_for(
            "the reload banner gone",
            "return document.getElementById('banner-reload') === null",
            json!(true),
        )
        .await;
    redis.kill();
    browser
        .wait_for(
            "the not-ready banner",
            "const b = document.getElementById('banner-ready'); return b ? b.textContent.startsWith('Not ready (/readyz answers 503): ') : null",
            json!(true),
        )
        .await;
    // `on_error: local` (the default) decides alone, each limit divided by the two
    // live instances it saw: a banner says so, and the fleet card.
    browser
        .wait_for(
            "the degraded banner",
            "const b = document.getElementById('banner-degraded'); return b ? b.textContent : null",
            json!("Degraded: Redis unreachable; on_error local enforces each limit divided by 2 (the live instances last seen), rounded up, in this instance."),
        )
        .await;
    browser
        .wait_for(
            "the fleet card's degraded note",
            "return document.getElementById('fleet-note').textContent.startsWith('degraded: limits divided by 2 in each instance while Redis is unreachable; ')",
            json!(true),
        )
        .await;
    browser.quit().await;
}

/// The page in Chromium on what a first week in production showed wrong: a cost
/// from the response written out (not `[object Object]`); a route whose every
/// request got 502 shows its upstream errors (a counter, a line on the chart, the
/// recent chips) and its target left out; an offender already denied is marked,
/// not offered again; and a deny click asks once more before it acts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_in_chromium_shows_upstream_errors_target_states_and_denied_offenders() {
    let up = upstream().await;
    let dead = format!("http://127.0.0.1:{}", free_port());
    let yaml = format!(
        r#"
upstreams:
  app: {{targets: ["{}"]}}
  gone: {{targets: ["{dead}"], probe: false}}
routes:
  - name: api
    match: {{path_prefix: /api/}}
    upstream: app
    key: header:x-api-key
    limits:
      - {{name: burst, algorithm: token_bucket, rate: 1/h, burst: 1}}
      - {{name: tokens, algorithm: fixed_window, limit: 1000, window: 1h, cost: {{response_header: x-cost, default: 2}}}}
  - name: broken
    match: {{path_prefix: /broken/}}
    upstream: gone
"#,
        up.url()
    );
    let sluice = SluiceProcess::start(&[], &[], &yaml).await;
    let c = http1();
    let broken = statuses(&c, 30, &url(sluice.addr, "/broken/x"), &[]).await;
    assert_eq!(broken, vec![502; 30]);
    // Two offenders: each allowed once, then refused twice.
    for key in ["eve", "mallory"] {
        let got = statuses(&c, 3, &url(sluice.addr, "/api/x"), &[("x-api-key", key)]).await;
        assert_eq!(got, ok_then_limited(1, 2));
    }
    // eve is denied already (through the API, as another operator would).
    let r = c
        .send(
            Method::POST,
            &url(sluice.admin, "/admin/deny"),
            &[("content-type", "application/json")],
            r#"{"key": "eve", "ttl": "1h"}"#,
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());

    let browser = webdriver::Browser::start().await;
    browser.open(&url(sluice.admin, "/")).await;
    let route_text = |route: &str, css: &str| {
        format!(
            "const e = document.querySelector('.route[data-route=\"{route}\"] {css}'); return e ? e.textContent : null"
        )
    };
    // The limits: the cost from the response in words.
    browser
        .wait_for(
            "api's limits",
            "return [...document.querySelectorAll('.route[data-route=\"api\"] .limits li')].map(e => e.textContent)",
            json!([
                "burst token_bucket rate 1/h, burst 1",
                "tokens fixed_window limit 1000, per 1h, cost from response header x-cost (default 2)"
            ]),
        )
        .await;
    // The broken route: its 30 requests allowed, and 30 upstream errors beside them.
    browser
        .wait_for(
            "broken's upstream errors",
            &route_text("broken", ".counter[data-decision=\"upstream_errors\"] .n"),
            json!("30"),
        )
        .await;
    assert_eq!(
        browser
            .eval(&route_text("broken", ".status[data-code=\"failed\"]"))
            .await,
        json!("not answered 30")
    );
    assert_eq!(
        browser
            .eval(&route_text("broken", ".status[data-code=\"failed\"].bad"))
            .await,
        json!("not answered 30")
    );
    // Its target is left out; api's is in use.
    assert_eq!(
        browser
            .eval(&route_text(
                "broken",
                &format!(".target[data-target=\"{dead}\"]")
            ))
            .await,
        json!(format!("{dead} out"))
    );
    assert_eq!(
        browser.eval(&route_text("api", ".target")).await,
        json!(format!("{} up", up.url()))
    );
    // On the chart: the errors line leaves the baseline.
    browser
        .wait_for(
            "broken's errors line",
            "const l = document.querySelector('.route[data-route=\"broken\"] svg.chart polyline.line.errors'); return l ? l.getAttribute('points').trim().split(/\\s+/).some(p => Number(p.split(',')[1]) < 76) : null",
            json!(true),
        )
        .await;

    // Offenders: eve marked as denied, with no button; mallory offered.
    let offender = |key: &str| {
        format!(
            "const r = document.querySelector('.route[data-route=\"api\"] table.top tr[data-key=\"{key}\"]'); return r ? [r.dataset.denied, [...r.querySelectorAll('button')].map(b => b.textContent), r.querySelector('td.actions').textContent] : null"
        )
    };
    browser
        .wait_for(
            "eve marked denied",
            &offender("eve"),
            json!(["key", [], "key denied"]),
        )
        .await;
    browser
        .wait_for(
            "mallory offered",
            &offender("mallory"),
            json!(["", ["Deny key", "Deny IP"], "Deny key Deny IP"]),
        )
        .await;
    // One click asks; nothing is denied yet.
    let deny_mallory = ".route[data-route=\"api\"] tr[data-key=\"mallory\"] button.remove";
    browser.click(&browser.find(deny_mallory).await).await;
    assert_eq!(
        browser
            .eval(&format!(
                "return document.querySelector('{deny_mallory}').textContent"
            ))
            .await,
        json!("Confirm deny key?")
    );
    let listed: Value =
        serde_json::from_slice(&get(&url(sluice.admin, "/admin/deny"), &[]).await.body).unwrap();
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");
    // The second denies it, and the row is marked.
    browser.click(&browser.find(deny_mallory).await).await;
    browser
        .wait_for(
            "mallory marked denied",
            &offender("mallory"),
            json!(["key", [], "key denied"]),
        )
        .await;
    assert_eq!(
        c.get(&url(sluice.addr, "/api/x"), &[("x-api-key", "mallory")])
            .await
            .status,
        403
    );
    browser.quit().await;
}

/// Envoy's rate limit service: a domain whose calls are refused gets a card of its
/// own with its top offenders (the refusing descriptor's value, the address).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_in_chromium_shows_a_rate_limit_domains_offenders() {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;

    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("edge.yaml"),
        "domain: edge\ndescriptors:\n  - key: remote_address\n    rate_limit: {unit: hour, requests_per_unit: 1}\n",
    )
    .unwrap();
    let gw = start_gateway(&format!(
        "rls: {{listen: \"127.0.0.1:0\", config_dir: \"{}\"}}\nroutes: []\n",
        dir.path().display()
    ))
    .await;
    let rls = gw.rls_addr.expect("rls listens");
    let mut c = bounded(
        "rls",
        RateLimitServiceClient::connect(format!("http://{rls}")),
    )
    .await
    .unwrap();
    let req = RateLimitRequest {
        domain: "edge".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "remote_address".into(),
                value: "203.0.113.9".into(),
            }],
            ..Default::default()
        }],
        hits_addend: 1,
    };
    let mut codes = Vec::new();
    for _ in 0..3 {
        let r = bounded("call", c.should_rate_limit(req.clone()))
            .await
            .unwrap();
        codes.push(r.into_inner().overall_code);
    }
    assert_eq!(codes, [1, 2, 2]);
    let browser = webdriver::Browser::start().await;
    browser.open(&url(gw.admin_addr, "/")).await;
    browser
        .wait_for(
            "the domain's offenders",
            "return [...document.querySelectorAll('.route[data-route=\"rls:edge\"] table.top tbody tr')].map(r => [...r.querySelectorAll('td')].slice(0, 3).map(td => td.textContent))",
            json!([["203.0.113.9", "203.0.113.9", "2"]]),
        )
        .await;
    browser.quit().await;
}
