//! A key is what the upstream reads: `sluice run` in front of real readers (PHP's
//! built-in server, a Go program using `encoding/json` and `FormValue`, Python's
//! `json.loads`). Each case sends the same request to the reader directly (what the
//! upstream reads) and through sluice (what sluice answers): no spelling an
//! upstream reads as one key buys a fresh budget or a way past the deny list.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use http::Method;

use crate::common::redis::SluiceProcess;
use crate::common::{
    eventually, free_port, h2c, http1, run_grouped, spawn_grouped, url, HttpClient, Spawned, BOUND,
};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/readers");

/// A reader upstream: a process of its own, listening on `addr`.
struct Reader {
    _process: Spawned,
    addr: SocketAddr,
}

impl Reader {
    async fn start(cmd: &mut Command, port: u16) -> Reader {
        let process = spawn_grouped(cmd).expect("the reader starts");
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let up = eventually(BOUND, || async {
            tokio::net::TcpStream::connect(addr).await.is_ok()
        })
        .await;
        assert!(up.is_some(), "the reader listens on {addr}");
        Reader {
            _process: process,
            addr,
        }
    }

    /// PHP's built-in server, reading `$_POST` and `$_GET`.
    async fn php() -> Reader {
        let port = free_port();
        let mut cmd = Command::new("php");
        cmd.arg("-S")
            .arg(format!("127.0.0.1:{port}"))
            .arg(Path::new(FIXTURES).join("reader.php"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        Reader::start(&mut cmd, port).await
    }

    /// Go's `net/http` with `encoding/json` and `FormValue`.
    async fn go() -> Reader {
        let port = free_port();
        let mut cmd = Command::new(go_reader());
        cmd.arg(format!("127.0.0.1:{port}"));
        Reader::start(&mut cmd, port).await
    }

    /// Python's `json.loads` of the body's bytes.
    async fn python() -> Reader {
        let port = free_port();
        let mut cmd = Command::new("/usr/bin/python3");
        cmd.arg(Path::new(FIXTURES).join("reader.py"))
            .arg(port.to_string());
        Reader::start(&mut cmd, port).await
    }

    fn target(&self) -> String {
        self.addr.to_string()
    }

    /// What the reader reads of `field` in this request, sent to it directly.
    async fn reads(&self, path: &str, field: &str, content_type: &str, body: &[u8]) -> String {
        let r = http1()
            .send(
                Method::POST,
                &url(self.addr, path),
                &[("content-type", content_type), ("x-read-field", field)],
                body.to_vec(),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text());
        let read = r.header("x-read").unwrap_or_default();
        percent_decode(read)
    }
}

fn percent_decode(s: &str) -> String {
    let s = s.replace('+', " ");
    let mut out = Vec::new();
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() + 1 {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The Go reader, built once per test run into cargo's scratch folder (the
/// standard library only: no module is fetched).
fn go_reader() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("go-reader");
            std::fs::create_dir_all(&dir).expect("scratch folder");
            let out = dir.join("reader");
            let built = run_grouped(
                Command::new("go")
                    .arg("build")
                    .arg("-o")
                    .arg(&out)
                    .arg(Path::new(FIXTURES).join("reader.go"))
                    .env("GOCACHE", dir.join("cache"))
                    .env("GOPATH", dir.join("path"))
                    .env("GOTOOLCHAIN", "local")
                    .env("GOFLAGS", "-mod=mod")
                    .env("GO111MODULE", "off"),
            )
            .expect("go runs");
            assert!(
                built.status.success(),
                "go build: {}",
                String::from_utf8_lossy(&built.stderr)
            );
            out
        })
        .clone()
}

/// `sluice run` with `routes` in front of upstream `up`, and `victim-denied` and
/// `Dora` on the deny list.
async fn gateway(up: &Reader, routes: &str) -> SluiceProcess {
    let yaml = format!(
        "upstreams:\n  up: {{targets: [\"http://{}\"]}}\ndeny: {{keys: [victim-denied, Dora]}}\nroutes:\n{routes}",
        up.target()
    );
    SluiceProcess::start(&[], &[], &yaml).await
}

/// A route `name` at `/name` to the reader, counting `key` (`extra`: more of its
/// fields, each a line), `limit` an hour.
fn route(name: &str, key: &str, extra: &str, limit: u32) -> String {
    format!(
        "  - name: {name}\n    match: {{path: /{name}}}\n    upstream: up\n    key: \"{key}\"\n{extra}    limits: [{{algorithm: fixed_window, limit: {limit}, window: 1h}}]\n"
    )
}

async fn post(c: &HttpClient, gw: &SluiceProcess, path: &str, ct: &str, body: &[u8]) -> u16 {
    c.send(
        Method::POST,
        &url(gw.addr, path),
        &[("content-type", ct)],
        body.to_vec(),
    )
    .await
    .status
}

const FORM: &str = "application/x-www-form-urlencoded";
const JSON: &str = "application/json";
const MULTIPART: &str = "multipart/form-data; boundary=b0undary";

fn multipart(name: &str, value: &str) -> Vec<u8> {
    format!(
        "--b0undary\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n--b0undary--\r\n"
    )
    .into_bytes()
}

/// Item 1: on a `casefold` account limit, `Carl`, `CARL`, `cArl` and fullwidth
/// `ｃａｒｌ` share `carl`'s budget, and a denied `Dora` is denied however she types
/// her name.
#[tokio::test]
async fn spellings_of_one_account_share_one_budget() {
    let go = Reader::go().await;
    let gw = gateway(
        &go,
        &route(
            "login",
            "json:/username",
            "    normalize_key: casefold
",
            2,
        ),
    )
    .await;
    let c = http1();
    let body = |u: &str| format!(r#"{{"username":"{u}"}}"#).into_bytes();
    assert_eq!(
        go.reads("/login", "username", JSON, &body("CARL")).await,
        "CARL"
    );
    let mut got = Vec::new();
    for u in ["carl", "carl", "Carl", "CARL", "cArl", "ｃａｒｌ"] {
        got.push(post(&c, &gw, "/login", JSON, &body(u)).await);
    }
    assert_eq!(got, [200, 200, 429, 429, 429, 429]);
    for u in ["Dora", "dora", "DORA", "ｄｏｒａ"] {
        assert_eq!(post(&c, &gw, "/login", JSON, &body(u)).await, 403, "{u}");
    }
}

/// Item 2: PHP reads `user%00` as `user`, so the NUL-named copy is a repeat (400)
/// in a form and a query, over HTTP/1.1 and h2c, and a denied value behind it is
/// denied.
#[tokio::test]
async fn php_reads_a_name_up_to_a_nul_byte() {
    let php = Reader::php().await;
    let gw = gateway(
        &php,
        &(route("form", "form:user", "", 2) + &route("query", "query:api_key", "", 2)),
    )
    .await;
    let split = b"user=fresh1&user%00=victim";
    assert_eq!(php.reads("/form", "user", FORM, split).await, "victim");
    let (c1, c2) = (http1(), h2c());
    let mut got = Vec::new();
    for c in [&c1, &c1, &c1, &c1, &c2, &c2] {
        got.push(post(c, &gw, "/form", FORM, split).await);
    }
    assert_eq!(got, [400, 400, 400, 400, 400, 400]);
    let denied = b"user=x&user%00=victim-denied";
    assert_eq!(
        php.reads("/form", "user", FORM, denied).await,
        "victim-denied"
    );
    assert_eq!(post(&c1, &gw, "/form", FORM, denied).await, 403);
    assert_eq!(post(&c2, &gw, "/form", FORM, denied).await, 403);

    let q = "/query?api_key=fresh&api_key%00=victim";
    assert_eq!(php.reads(q, "api_key", FORM, b"").await, "victim");
    for c in [&c1, &c2] {
        assert_eq!(c.get(&url(gw.addr, q), &[]).await.status, 400);
    }
    let q = "/query?api_key=x&api_key%00=victim-denied";
    assert_eq!(c1.get(&url(gw.addr, q), &[]).await.status, 403);
    // One NUL-named copy alone is the key: it counts as `victim`.
    let q = "/query?api_key%00=victim";
    let mut one = Vec::new();
    for _ in 0..3 {
        one.push(c1.get(&url(gw.addr, q), &[]).await.status);
    }
    assert_eq!(one, [200, 200, 429]);
    assert_eq!(
        c1.get(&url(gw.addr, "/query?api_key=victim"), &[])
            .await
            .status,
        429
    );
}

/// Item 3: Go's `encoding/json` matches member names ignoring case (and `ſ` for
/// `s`): a second member that Go reads as the key's is a repeat (400), and a
/// denied value in it is denied; one alone is the key.
#[tokio::test]
async fn go_reads_member_names_ignoring_case() {
    let go = Reader::go().await;
    let gw = gateway(&go, &route("login", "json:/user", "", 2)).await;
    let c = http1();
    let two = br#"{"user":"fresh","USER":"victim"}"#;
    assert_eq!(go.reads("/login", "user", JSON, two).await, "victim");
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(post(&c, &gw, "/login", JSON, two).await);
    }
    assert_eq!(got, [400, 400, 400]);
    let long_s = r#"{"user":"f9","uſer":"victim-denied"}"#.as_bytes();
    assert_eq!(
        go.reads("/login", "user", JSON, long_s).await,
        "victim-denied"
    );
    assert_eq!(post(&c, &gw, "/login", JSON, long_s).await, 403);
    // `USER` alone is the key `user`: one budget with `user`.
    let mut got = Vec::new();
    for body in [r#"{"USER":"v2"}"#, r#"{"uſer":"v2"}"#, r#"{"user":"v2"}"#] {
        got.push(post(&c, &gw, "/login", JSON, body.as_bytes()).await);
    }
    assert_eq!(got, [200, 200, 429]);
}

/// Item 4: with `missing_key: ip`, a multipart login and a JSON body that starts
/// with a byte order mark are read for their key (PHP, Go and Python read them),
/// so the deny list sees them and they share the key's budget.
#[tokio::test]
async fn bodies_the_upstream_reads_are_read_for_the_key() {
    let (php, go, py) = (
        Reader::php().await,
        Reader::go().await,
        Reader::python().await,
    );
    let ip = "    missing_key: ip
";
    let routes = &(route("form", "form:user", ip, 2) + &route("json", "json:/user", ip, 2));
    let c = http1();
    let denied = multipart("user", "victim-denied");
    assert_eq!(
        php.reads("/form", "user", MULTIPART, &denied).await,
        "victim-denied"
    );
    assert_eq!(
        go.reads("/form", "user", MULTIPART, &denied).await,
        "victim-denied"
    );
    let gw = gateway(&php, routes).await;
    assert_eq!(post(&c, &gw, "/form", MULTIPART, &denied).await, 403);
    // One key, however the form is sent.
    let mut got = Vec::new();
    got.push(post(&c, &gw, "/form", MULTIPART, &multipart("user", "m1")).await);
    got.push(post(&c, &gw, "/form", FORM, b"user=m1").await);
    got.push(post(&c, &gw, "/form", MULTIPART, &multipart("user", "m1")).await);
    // A fresh address would not help: the key is `m1`.
    got.push(post(&c, &gw, "/form", MULTIPART, &multipart("user", "m2")).await);
    assert_eq!(got, [200, 200, 429, 200]);

    let bom = "\u{FEFF}{\"user\":\"victim-denied\"}".as_bytes();
    assert_eq!(py.reads("/json", "user", JSON, bom).await, "victim-denied");
    let gw = gateway(&py, routes).await;
    assert_eq!(post(&c, &gw, "/json", JSON, bom).await, 403);
}

/// Item 5: a username in any script is a key, composed and decomposed spellings
/// one; characters an upstream may drop are refused.
#[tokio::test]
async fn international_usernames_log_in() {
    let go = Reader::go().await;
    let gw = gateway(&go, &route("login", "json:/username", "", 2)).await;
    let c = http1();
    let composed = r#"{"username":"José"}"#.as_bytes();
    let decomposed = br#"{"username":"Jose\u0301"}"#;
    assert_eq!(go.reads("/login", "username", JSON, composed).await, "José");
    let r = c
        .send(
            Method::POST,
            &url(gw.addr, "/login"),
            &[("content-type", JSON), ("x-read-field", "username")],
            composed.to_vec(),
        )
        .await;
    assert_eq!((r.status, r.text()), (200, "José"));
    let mut got = Vec::new();
    for body in [composed, decomposed] {
        got.push(post(&c, &gw, "/login", JSON, body).await);
    }
    assert_eq!(got, [200, 429]);
    assert_eq!(
        post(
            &c,
            &gw,
            "/login",
            JSON,
            r#"{"username":"李小龍"}"#.as_bytes()
        )
        .await,
        200
    );
    for bad in [
        &br#"{"username":"Jo\u200bse"}"#[..],
        br#"{"username":"\u202eesoJ"}"#,
    ] {
        assert_eq!(post(&c, &gw, "/login", JSON, bad).await, 400);
    }
}

/// Item 6: a key entry denies the key `/admin/top` shows, also where that key is
/// the client's address (`key: ip`, or `missing_key: ip`'s fallback): the
/// dashboard's "Deny key" button denies.
#[tokio::test]
async fn a_key_entry_denies_an_address_key() {
    let go = Reader::go().await;
    let gw = gateway(
        &go,
        &(route("ip", "ip", "", 1)
            + &route(
                "h",
                "header:x-api-key",
                "    missing_key: ip
",
                100,
            )),
    )
    .await;
    let c = http1();
    let statuses = |path: &'static str| {
        let (c, addr) = (&c, gw.addr);
        async move {
            let mut got = Vec::new();
            for _ in 0..2 {
                got.push(c.get(&url(addr, path), &[]).await.status);
            }
            got
        }
    };
    assert_eq!(statuses("/ip").await, [200, 429]);
    assert_eq!(statuses("/h").await, [200, 200]);
    let top = c.get(&url(gw.admin, "/admin/top?route=ip"), &[]).await;
    assert!(top.text().contains("\"127.0.0.1\""), "{}", top.text());
    let added = c
        .send(
            Method::POST,
            &url(gw.admin, "/admin/deny"),
            &[("content-type", JSON)],
            r#"{"key": "127.0.0.1"}"#,
        )
        .await;
    assert_eq!(added.status, 201, "{}", added.text());
    let denied = eventually(Duration::from_secs(2), || async {
        c.get(&url(gw.addr, "/ip"), &[]).await.status == 403
    })
    .await;
    assert!(denied.is_some(), "the key entry denies the address key");
    assert_eq!(statuses("/h").await, [403, 403]);
    // A request that has its key is counted by it, not the address.
    let r = c.get(&url(gw.addr, "/h"), &[("x-api-key", "k1")]).await;
    assert_eq!(r.status, 200);
}

/// Multipart bodies framed for one reader: a part after the closing delimiter
/// (PHP), a head ending in LF CRLF (PHP and Go), PHP's reading of a second
/// `boundary` (`xboundary=`), RFC 2231 name pieces (Go), and a query parameter
/// that Go's `FormValue` reads before the body. Each reader reads the denied
/// value: sluice denies it, and a varying decoy never buys a budget.
#[tokio::test]
async fn multipart_bodies_framed_for_one_reader() {
    let (php, go) = (Reader::php().await, Reader::go().await);
    let routes = route("form", "form:user", "", 2);
    let part = |head: &str, value: &str| {
        format!("--AAA\r\nContent-Disposition: form-data; {head}\r\n\r\n{value}\r\n")
    };
    let decoy = |n: usize| part("name=\"user\"", &format!("decoy{n}"));
    const AAA: &str = "multipart/form-data; boundary=AAA";
    // (reader, content type, body with the decoy `n`, path)
    type Body<'a> = Box<dyn Fn(usize) -> String + 'a>;
    let cases: Vec<(&Reader, &str, Body<'_>, &str)> = vec![
        (
            &php,
            AAA,
            Box::new(move |n| {
                format!(
                    "{}--AAA--\r\n{}--AAA--\r\n",
                    decoy(n),
                    part("name=\"user\"", "victim-denied")
                )
            }),
            "/form",
        ),
        (
            &go,
            AAA,
            Box::new(move |n| {
                format!(
                    "--AAA\r\nContent-Disposition: form-data; name=\"user\"\n\r\nvictim-denied\r\n{}--AAA--\r\n",
                    decoy(n)
                )
            }),
            "/form",
        ),
        (
            &php,
            "multipart/form-data; xboundary=AAA; boundary=BBB",
            Box::new(move |n| {
                format!(
                    "--BBB\r\nContent-Disposition: form-data; name=\"user\"\r\n\r\ndecoy{n}\r\n--BBB--\r\n{}--AAA--\r\n",
                    part("name=\"user\"", "victim-denied")
                )
            }),
            "/form",
        ),
        (
            &go,
            AAA,
            Box::new(move |n| {
                format!(
                    "{}{}--AAA--\r\n",
                    part("name*0=\"us\"; name*1=\"er\"", "victim-denied"),
                    decoy(n)
                )
            }),
            "/form",
        ),
        (
            &go,
            AAA,
            Box::new(move |n| format!("{}--AAA--\r\n", decoy(n))),
            "/form?user=victim-denied",
        ),
    ];
    let c = http1();
    for (i, (reader, ct, body, path)) in cases.iter().enumerate() {
        let read = reader.reads(path, "user", ct, body(0).as_bytes()).await;
        assert_eq!(read, "victim-denied", "case {i}: what the reader reads");
        let gw = gateway(reader, &routes).await;
        let mut got = Vec::new();
        for n in 0..3 {
            got.push(post(&c, &gw, path, ct, body(n).as_bytes()).await);
        }
        assert_eq!(got, [403, 403, 403], "case {i}");
    }
}

/// A JSON body Python reads and serde_json does not (UTF-16, `NaN`), on a route
/// with `missing_key: ip`: counted by address, but its denied key is denied.
#[tokio::test]
async fn json_a_lenient_parser_reads_is_seen_by_the_deny_list() {
    let py = Reader::python().await;
    let gw = gateway(
        &py,
        &route("json", "json:/user", "    missing_key: ip\n", 100),
    )
    .await;
    let c = http1();
    let utf16: Vec<u8> =
        r#"{"user": "victim-denied"}"#.encode_utf16().flat_map(u16::to_le_bytes).collect();
    let nan = br#"{"user": "victim-denied", "x": NaN}"#.to_vec();
    for body in [utf16, nan] {
        assert_eq!(
            py.reads("/json", "user", JSON, &body).await,
            "victim-denied"
        );
        assert_eq!(post(&c, &gw, "/json", JSON, &body).await, 403);
    }
}
