//! `sluice deny`, the admin API client, run as the real binary against a gateway
//! started in this process: what it prints, its exit codes, where it finds the
//! admin address and token, and that what it adds and removes takes effect.

use std::io::Read;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::common::*;
use serde_json::Value;

const SLUICE: &str = env!("CARGO_BIN_EXE_sluice");
const TOKEN: &str = "s3cret";
const UNAUTHORIZED: &str = "sluice deny: 401 Unauthorized: missing or wrong bearer token \
                            (set SLUICE_ADMIN_TOKEN or admin.token)\n";

/// A gateway whose admin API wants `token` (written as is into the file, so it may
/// be a `${VAR}`), behind a trusted loopback proxy so that `X-Forwarded-For` can
/// play any client address; `/ip` is keyed by address, `/key` by `x-api-key`.
fn config(admin_listen: &str, token: &str) -> String {
    format!(
        r#"
server: {{listen: "127.0.0.1:0"}}
admin: {{listen: "{admin_listen}", token: "{token}"}}
client_ip: {{trusted_proxies: [127.0.0.1/32]}}
deny: {{keys: [static-key]}}
routes:
  - {{name: by-ip, match: {{path: /ip}}, key: ip, respond: {{body: ok}}}}
  - {{name: by-key, match: {{path: /key}}, key: "header:x-api-key", respond: {{body: ok}}}}
"#
    )
}

async fn gateway() -> (Running, tempfile::NamedTempFile) {
    start_gateway_file(&config("127.0.0.1:0", TOKEN)).await
}

// === running `sluice deny` ===

/// How `sluice deny` ended.
#[derive(Debug, PartialEq, Eq)]
struct Out {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Out {
    fn ok(stdout: &str) -> Out {
        Out {
            code: Some(0),
            stdout: stdout.to_string(),
            stderr: String::new(),
        }
    }

    fn failed(stderr: &str) -> Out {
        Out {
            code: Some(1),
            stdout: String::new(),
            stderr: stderr.to_string(),
        }
    }
}

fn drain(pipe: Option<impl Read + Send + 'static>) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(mut p) = pipe {
            let _ = p.read_to_string(&mut text);
        }
        text
    })
}

/// Run `sluice deny ARGS` with `env` set and neither `SLUICE_CONFIG` nor
/// `SLUICE_ADMIN_TOKEN` inherited. Waits without blocking the runtime, so the
/// gateway in this process keeps answering, and for at most twice `BOUND` (the
/// client bounds each call by 10 s itself).
async fn deny(args: &[&str], env: &[(&str, &str)]) -> Out {
    client("deny", args, env).await
}

/// Run `sluice COMMAND ARGS` (an admin client: `deny`, `top`, `fleet`) as `deny`
/// does.
async fn client(command: &str, args: &[&str], env: &[(&str, &str)]) -> Out {
    let mut cmd = Command::new(SLUICE);
    cmd.arg(command)
        .args(args)
        .env_remove("SLUICE_CONFIG")
        .env_remove("SLUICE_ADMIN_TOKEN")
        .env("SLUICE_LOG", "warn")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // In its own process group, killed with the group if the test ends first.
    let mut child = spawn_grouped(&mut cmd).expect("sluice starts");
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let limit = 2 * BOUND;
    let mut waited = Duration::ZERO;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            waited < limit,
            "sluice {command} {args:?} still running after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
        waited += Duration::from_millis(20);
    };
    Out {
        code: status.code(),
        stdout: stdout.join().expect("stdout"),
        stderr: stderr.join().expect("stderr"),
    }
}

/// `sluice deny ARGS --admin http://ADMIN` with the right token in the environment.
async fn deny_at(admin: SocketAddr, args: &[&str]) -> Out {
    let url = format!("http://{admin}");
    let mut all = args.to_vec();
    all.extend(["--admin", &url]);
    deny(&all, &[("SLUICE_ADMIN_TOKEN", TOKEN)]).await
}

/// `GET /admin/deny` directly.
async fn api_list(admin: SocketAddr) -> String {
    let bearer = format!("Bearer {TOKEN}");
    let r = get(&url(admin, "/admin/deny"), &[("authorization", &bearer)]).await;
    assert_eq!(r.status, 200, "GET /admin/deny: {}", r.text());
    r.text().to_string()
}

// === the gateway's view ===

/// The status of `GET path` from client address `ip`, with `x-api-key: key` if
/// given, once it is `want`: entries may take effect a moment after the API
/// answered. Returns the last status seen.
async fn status_from(gw: &Running, path: &str, ip: &str, key: Option<&str>, want: u16) -> u16 {
    let c = http1();
    let u = url(gw.addr, path);
    let mut headers = vec![("x-forwarded-for", ip)];
    if let Some(k) = key {
        headers.push(("x-api-key", k));
    }
    let mut status = 0;
    for _ in 0..40 {
        status = c.get(&u, &headers).await.status;
        if status == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    status
}

// === RFC 3339 ===

/// Seconds since the epoch of `YYYY-MM-DDTHH:MM:SS[.frac]Z`.
fn unix_secs(rfc3339: &str) -> i64 {
    let b = rfc3339.as_bytes();
    assert!(
        b.len() >= 20 && b[4] == b'-' && b[10] == b'T' && rfc3339.ends_with('Z'),
        "not RFC 3339 UTC: {rfc3339}"
    );
    let n = |r: std::ops::Range<usize>| -> i64 { rfc3339[r].parse().expect(rfc3339) };
    let (y, m, d) = (n(0..4), n(5..7), n(8..10));
    // Days from civil (Howard Hinnant).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    days * 86_400 + n(11..13) * 3600 + n(14..16) * 60 + n(17..19)
}

fn now_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs() as i64
}

// === tests ===

#[tokio::test]
async fn an_address_is_added_listed_enforced_and_removed() {
    let (gw, _file) = gateway().await;
    let admin = gw.admin_addr;
    assert_eq!(status_from(&gw, "/ip", "203.0.113.7", None, 200).await, 200);

    let before = now_secs();
    let out = deny_at(
        admin,
        &[
            "add",
            "--ip",
            "203.0.113.7",
            "--ttl",
            "10m",
            "--reason",
            "scraping",
        ],
    )
    .await;
    let after = now_secs();
    assert_eq!(
        out,
        Out::ok("denied ip 203.0.113.7 for 10m (reason: scraping)\n")
    );
    assert_eq!(status_from(&gw, "/ip", "203.0.113.7", None, 403).await, 403);
    assert_eq!(status_from(&gw, "/ip", "203.0.113.8", None, 200).await, 200);

    // --json prints the API's answer unchanged.
    let json = api_list(admin).await;
    let out = deny_at(admin, &["list", "--json"]).await;
    let expected = if json.ends_with('\n') {
        json.clone()
    } else {
        format!("{json}\n")
    };
    assert_eq!(out, Out::ok(&expected));

    // The entry expires ten minutes after it was added.
    let entries: Vec<Value> = serde_json::from_str(&json).expect("a JSON list");
    let added = entries
        .iter()
        .find(|e| e["value"] == "203.0.113.7")
        .unwrap_or_else(|| panic!("203.0.113.7 not listed: {json}"));
    assert_eq!(
        (&added["kind"], &added["source"], &added["reason"]),
        (
            &Value::from("ip"),
            &Value::from("api"),
            &Value::from("scraping")
        )
    );
    let expires = added["expires_at"].as_str().expect("expires_at");
    let at = unix_secs(expires);
    assert!(
        (before + 600..=after + 601).contains(&at),
        "expires_at {expires} is not 10m after {before}..{after}"
    );

    let out = deny_at(admin, &["list"]).await;
    assert_eq!(
        out,
        Out::ok(&format!(
            "KIND  VALUE        SOURCE  EXPIRES{pad}  REASON\n\
             key   static-key   static  never{pad2}  -\n\
             ip    203.0.113.7  api     {expires}  scraping\n",
            pad = " ".repeat(expires.len() - "EXPIRES".len()),
            pad2 = " ".repeat(expires.len() - "never".len()),
        ))
    );

    let out = deny_at(admin, &["remove", "--ip", "203.0.113.7"]).await;
    assert_eq!(out, Out::ok("removed ip 203.0.113.7\n"));
    assert_eq!(
        deny_at(admin, &["list"]).await,
        Out::ok(
            "KIND  VALUE       SOURCE  EXPIRES  REASON\n\
             key   static-key  static  never    -\n"
        )
    );
    assert_eq!(status_from(&gw, "/ip", "203.0.113.7", None, 200).await, 200);
    gw.shutdown().await;
}

#[tokio::test]
async fn blocks_of_both_families_and_a_key() {
    let (gw, _file) = gateway().await;
    let admin = gw.admin_addr;

    // Host bits are dropped, as in `deny.ips`.
    let out = deny_at(admin, &["add", "--ip", "10.1.2.3/16"]).await;
    assert_eq!(out, Out::ok("denied ip 10.1.0.0/16 until removed\n"));
    let out = deny_at(admin, &["add", "--ip", "2001:db8::/32", "--ttl", "1h"]).await;
    assert_eq!(out, Out::ok("denied ip 2001:db8::/32 for 1h\n"));
    let out = deny_at(
        admin,
        &["add", "--key", "leaked-key-9", "--reason", "leaked"],
    )
    .await;
    assert_eq!(
        out,
        Out::ok("denied key leaked-key-9 until removed (reason: leaked)\n")
    );

    assert_eq!(status_from(&gw, "/ip", "10.1.200.3", None, 403).await, 403);
    assert_eq!(status_from(&gw, "/ip", "10.2.0.1", None, 200).await, 200);
    assert_eq!(
        status_from(&gw, "/ip", "2001:db8:ff::7", None, 403).await,
        403
    );
    assert_eq!(status_from(&gw, "/ip", "2001:db9::7", None, 200).await, 200);
    let key = Some("leaked-key-9");
    assert_eq!(status_from(&gw, "/key", "192.0.2.1", key, 403).await, 403);
    let other = Some("another-key");
    assert_eq!(status_from(&gw, "/key", "192.0.2.1", other, 200).await, 200);

    let listed = deny_at(admin, &["list"]).await;
    assert_eq!((listed.code, listed.stderr.as_str()), (Some(0), ""));
    let mut lines: Vec<&str> = listed.stdout.lines().collect();
    let header = lines.remove(0);
    assert!(header.starts_with("KIND  VALUE "), "{}", listed.stdout);
    let (expiring, mut lasting): (Vec<&str>, Vec<&str>) =
        lines.into_iter().partition(|l| l.contains("2001:db8::/32"));
    assert_eq!(expiring.len(), 1, "{}", listed.stdout);
    let expires = expiring[0].split_whitespace().nth(3).expect("EXPIRES");
    let in_an_hour = unix_secs(expires) - now_secs();
    assert!((3590..=3600).contains(&in_an_hour), "{}", listed.stdout);
    assert_eq!(
        expiring[0],
        format!("ip    2001:db8::/32  api     {expires}  -")
    );
    let never = format!("never{}", " ".repeat(expires.len() - "never".len()));
    lasting.sort_unstable();
    assert_eq!(
        lasting,
        [
            format!("ip    10.1.0.0/16    api     {never}  -"),
            format!("key   leaked-key-9   api     {never}  leaked"),
            format!("key   static-key     static  {never}  -"),
        ],
        "{}",
        listed.stdout
    );

    for args in [
        ["remove", "--ip", "10.1.0.0/16"],
        ["remove", "--ip", "2001:db8::/32"],
        ["remove", "--key", "leaked-key-9"],
    ] {
        let out = deny_at(admin, &args).await;
        let what = args[1].trim_start_matches("--");
        assert_eq!(out, Out::ok(&format!("removed {what} {}\n", args[2])));
    }
    assert_eq!(status_from(&gw, "/ip", "10.1.200.3", None, 200).await, 200);
    assert_eq!(
        status_from(&gw, "/ip", "2001:db8:ff::7", None, 200).await,
        200
    );
    assert_eq!(status_from(&gw, "/key", "192.0.2.1", key, 200).await, 200);
    gw.shutdown().await;
}

#[tokio::test]
async fn the_api_refusals_are_one_line_and_exit_1() {
    let (gw, _file) = gateway().await;
    let url = format!("http://{}", gw.admin_addr);

    // A wrong token, and none at all.
    let wrong = [("SLUICE_ADMIN_TOKEN", "wrong")];
    let out = deny(&["list", "--admin", &url], &wrong).await;
    assert_eq!(out, Out::failed(UNAUTHORIZED));
    let out = deny(&["add", "--key", "k", "--admin", &url], &[]).await;
    assert_eq!(out, Out::failed(UNAUTHORIZED));

    // Nothing to remove.
    let out = deny_at(gw.admin_addr, &["remove", "--ip", "198.51.100.1"]).await;
    assert_eq!(
        out,
        Out::failed("sluice deny: 404 Not Found: no such entry\n")
    );

    // What rules.yaml denies only rules.yaml can allow again.
    let out = deny_at(gw.admin_addr, &["remove", "--key", "static-key"]).await;
    assert_eq!((out.code, out.stdout.as_str()), (Some(1), ""));
    assert!(
        out.stderr.starts_with("sluice deny: 409 Conflict: ") && out.stderr.lines().count() == 1,
        "{}",
        out.stderr
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn an_admin_api_nobody_listens_on_cannot_be_reached() {
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let out = deny(&["list", "--admin", &url], &[]).await;
    assert_eq!(
        out,
        Out::failed(&format!(
            "sluice deny: cannot reach the admin API at {url}: connection refused\n"
        ))
    );
}

#[tokio::test]
async fn usage_errors_come_before_any_call() {
    // Anything that connected here would show as a pending connection.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let cases: [(&[&str], &str); 6] = [
        (
            &["add", "--ip", "300.1.2.3"],
            "error: invalid value '300.1.2.3' for '--ip <ADDR[/LEN]>': \
             expected an IP address or a CIDR block like 10.0.0.0/8",
        ),
        (
            &["add", "--ip", "10.0.0.0/33"],
            "error: invalid value '10.0.0.0/33' for '--ip <ADDR[/LEN]>': \
             expected an IP address or a CIDR block like 10.0.0.0/8",
        ),
        (
            &["add", "--key", "k", "--ip", "10.0.0.1"],
            "error: the argument '--key <K>' cannot be used with '--ip <ADDR[/LEN]>'",
        ),
        (
            &["remove"],
            "error: the following required arguments were not provided:",
        ),
        (
            &["add", "--key", "k", "--ttl", "10 minutes"],
            "error: invalid value '10 minutes' for '--ttl <D>': \
             expected a duration like 250ms, 10s, 1m, 1h or 1d",
        ),
        (
            &["add", "--key", ""],
            "error: invalid value '' for '--key <K>': a key cannot be empty",
        ),
    ];
    for (args, first_line) in cases {
        let mut all = args.to_vec();
        all.extend(["--admin", &url]);
        let out = deny(&all, &[("SLUICE_ADMIN_TOKEN", TOKEN)]).await;
        assert_eq!(
            (out.code, out.stdout.as_str(), out.stderr.lines().next()),
            (Some(2), "", Some(first_line)),
            "{args:?}: {}",
            out.stderr
        );
    }
    assert!(
        listener.accept().is_err(),
        "a usage error still called the API"
    );
}

#[tokio::test]
async fn address_and_token_come_from_the_config_file() {
    let (gw, _file) = gateway().await;
    // The same gateway as the client's file describes it: listening on every
    // address (so the client connects to 127.0.0.1) with the token in a variable.
    let listen = format!("0.0.0.0:{}", gw.admin_addr.port());
    let own = config_file(&config(&listen, "${DENY_TEST_TOKEN}"));
    let path = own.path().display().to_string();

    let from_file = [("DENY_TEST_TOKEN", TOKEN)];
    let out = deny(&["add", "--key", "k1", "-c", &path], &from_file).await;
    assert_eq!(out, Out::ok("denied key k1 until removed\n"));

    // SLUICE_ADMIN_TOKEN wins over admin.token, both ways.
    let env_wrong = [("DENY_TEST_TOKEN", TOKEN), ("SLUICE_ADMIN_TOKEN", "wrong")];
    let out = deny(&["remove", "--key", "k1", "-c", &path], &env_wrong).await;
    assert_eq!(out, Out::failed(UNAUTHORIZED));
    let env_right = [("DENY_TEST_TOKEN", "wrong"), ("SLUICE_ADMIN_TOKEN", TOKEN)];
    let out = deny(&["remove", "--key", "k1", "-c", &path], &env_right).await;
    assert_eq!(out, Out::ok("removed key k1\n"));

    // SLUICE_CONFIG names the file when -c does not.
    let env = [("DENY_TEST_TOKEN", TOKEN), ("SLUICE_CONFIG", path.as_str())];
    let out = deny(&["list"], &env).await;
    assert_eq!(
        out,
        Out::ok(
            "KIND  VALUE       SOURCE  EXPIRES  REASON\n\
             key   static-key  static  never    -\n"
        )
    );

    // --admin wins over admin.listen.
    let elsewhere = config_file(&config(&format!("127.0.0.1:{}", free_port()), TOKEN));
    let elsewhere = elsewhere.path().display().to_string();
    let url = format!("http://{}", gw.admin_addr);
    let out = deny(&["list", "-c", &elsewhere, "--admin", &url], &[]).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    gw.shutdown().await;
}

/// The admin clients read only the `admin` section of `-c FILE`: a variable unset
/// elsewhere (the gateway's own listener, a route's key) is no error for them.
#[tokio::test]
async fn the_clients_read_only_the_admin_section() {
    let (gw, _file) = gateway().await;
    let listen = format!("127.0.0.1:{}", gw.admin_addr.port());
    let text = config(&listen, TOKEN)
        .replace("127.0.0.1:0", "${DENY_TEST_UNSET_LISTEN}")
        .replace("header:x-api-key", "header:${DENY_TEST_UNSET_HEADER}");
    assert!(text.contains("${DENY_TEST_UNSET_LISTEN}"), "{text}");
    let own = config_file(&text);
    let path = own.path().display().to_string();
    let out = deny(&["list", "-c", &path], &[]).await;
    assert_eq!(
        out,
        Out::ok(
            "KIND  VALUE       SOURCE  EXPIRES  REASON\n\
             key   static-key  static  never    -\n"
        )
    );
    for command in ["top", "fleet"] {
        let out = client(command, &["--json", "-c", &path], &[]).await;
        assert_eq!(
            (out.code, out.stderr.as_str()),
            (Some(0), ""),
            "sluice {command}"
        );
    }
    gw.shutdown().await;
}

#[tokio::test]
async fn a_bad_config_file_needs_admin_and_then_counts_for_nothing() {
    let (gw, _file) = gateway().await;
    let url = format!("http://{}", gw.admin_addr);
    let hint = "hint: pass --admin URL (e.g. --admin http://127.0.0.1:9091) \
                to reach the admin API without the configuration file\n";

    let out = deny(&["list", "-c", "/nonexistent/sluice.yaml"], &[]).await;
    assert_eq!(
        out,
        Out::failed(&format!(
            "sluice deny: /nonexistent/sluice.yaml: cannot read: \
             No such file or directory (os error 2)\n{hint}"
        ))
    );

    // An invalid admin section: its error with line and column, then the hint.
    let typo =
        config(&format!("127.0.0.1:{}", gw.admin_addr.port()), TOKEN).replace("token:", "tokn:");
    let col = typo.lines().nth(2).and_then(|l| l.find("tokn")).unwrap() + 1;
    let typo = config_file(&typo);
    let path = typo.path().display().to_string();
    let out = deny(&["list", "-c", &path], &[]).await;
    assert_eq!((out.code, out.stdout.as_str()), (Some(1), ""));
    assert!(
        out.stderr.starts_with(&format!(
            "sluice deny: {path}:3:{col}: admin: unknown field `tokn`"
        )) && out.stderr.ends_with(hint),
        "{}",
        out.stderr
    );

    // With --admin, a missing file is fine, and an invalid one gives nothing, not
    // even its token.
    let token = [("SLUICE_ADMIN_TOKEN", TOKEN)];
    let out = deny(
        &["list", "-c", "/nonexistent/sluice.yaml", "--admin", &url],
        &token,
    )
    .await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let out = deny(&["list", "-c", &path, "--admin", &url], &[]).await;
    assert_eq!(out, Out::failed(UNAUTHORIZED));
    let out = deny(&["list", "-c", &path, "--admin", &url], &token).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    gw.shutdown().await;
}

/// A block wider than /8 needs `--force`; without it the API's 400 says why and
/// nothing is added.
#[tokio::test]
async fn a_wide_block_needs_force() {
    let (gw, _file) = gateway().await;
    let admin = gw.admin_addr;
    let out = deny_at(admin, &["add", "--ip", "1.2.3.4/0"]).await;
    assert_eq!(
        out,
        Out::failed(
            "sluice deny: 400 Bad Request: ip 0.0.0.0/0 is wider than /8 (IPv4) or /32 (IPv6) and would deny a large part of the internet; send \"force\": true (sluice deny --force) if that is meant\n"
        )
    );
    assert_eq!(status_from(&gw, "/ip", "192.0.2.1", None, 200).await, 200);
    let out = deny_at(admin, &["add", "--ip", "1.2.3.4/0", "--force"]).await;
    assert_eq!(out, Out::ok("denied ip 0.0.0.0/0 until removed\n"));
    assert_eq!(status_from(&gw, "/ip", "192.0.2.1", None, 403).await, 403);
    gw.shutdown().await;
}

/// A key with format characters (a right-to-left override, a zero-width space, a
/// tag character), an invisible filler, or white space around it is refused: no
/// request can carry it (such keys get 400 before the deny list is read, or are
/// read trimmed). A
/// reason may hold any text; its format and invisible characters are listed
/// escaped, so it cannot reorder or blank out what the table shows; `--json`
/// keeps it exact.
#[tokio::test]
async fn format_characters_are_listed_escaped() {
    let (gw, _file) = gateway().await;
    let admin = gw.admin_addr;
    for key in ["abc\u{202E}fed\u{200B}\u{E0041}", "bad\u{3164}", "k\u{a0}"] {
        let out = deny_at(admin, &["add", "--key", key]).await;
        assert_eq!(
            out,
            Out::failed("sluice deny: 400 Bad Request: key holds a control, format, private-use or unassigned character, or white space around it: no request has such a key, so it could never match\n"),
            "{key:?}"
        );
    }
    let reason = "abc\u{202E}fed\u{200B}\u{E0041} \u{3164}\u{2028}ok \u{e9}t\u{e9}";
    let shown = "abc\\u{202e}fed\\u{200b}\\u{e0041} \\u{3164}\\u{2028}ok \u{e9}t\u{e9}";
    let out = deny_at(admin, &["add", "--key", "k1", "--reason", reason]).await;
    assert_eq!(
        out,
        Out::ok(&format!("denied key k1 until removed (reason: {shown})\n"))
    );
    let out = deny_at(admin, &["list"]).await;
    assert_eq!(
        out,
        Out::ok(&format!(
            "KIND  VALUE       SOURCE  EXPIRES  REASON\n\
             key   static-key  static  never    -\n\
             key   k1          api     never    {shown}\n",
        ))
    );
    let out = deny_at(admin, &["list", "--json"]).await;
    let list: Value = serde_json::from_str(&out.stdout).expect("JSON");
    assert_eq!(list[1]["reason"], reason);
    gw.shutdown().await;
}

/// `sluice deny list` walks every page of the API (1000 entries a page).
#[tokio::test]
async fn list_walks_every_page() {
    let (gw, _file) = gateway().await;
    let c = http1();
    let bearer = format!("Bearer {TOKEN}");
    let u = url(gw.admin_addr, "/admin/deny");
    for i in 0..1100 {
        let body = format!(r#"{{"key":"bulk{i:04}"}}"#);
        let r = c
            .send(
                http::Method::POST,
                &u,
                &[
                    ("authorization", &bearer),
                    ("content-type", "application/json"),
                ],
                body,
            )
            .await;
        assert_eq!(r.status, 201, "{}", r.text());
    }
    let out = deny_at(gw.admin_addr, &["list", "--json"]).await;
    assert_eq!((out.code, out.stderr.as_str()), (Some(0), ""));
    let list: Vec<Value> = serde_json::from_str(&out.stdout).expect("JSON");
    let values: Vec<&str> = list.iter().map(|e| e["value"].as_str().unwrap()).collect();
    let mut expected = vec!["static-key".to_string()];
    expected.extend((0..1100).map(|i| format!("bulk{i:04}")));
    assert_eq!(values, expected);
    let out = deny_at(gw.admin_addr, &["list"]).await;
    assert_eq!(out.stdout.lines().count(), 1 + 1101);
    gw.shutdown().await;
}
