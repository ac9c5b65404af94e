//! Connections under hostile clients: upgrade tunnels that would carry requests past
//! the limits, `CONNECT`, idle HTTP/1.1 and h2c connections holding slots, the
//! per-IP connection cap, oversized request heads, the per-upstream connection
//! cap, and the open-file limit of the real binary.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

// === test upstreams ===

/// A raw HTTP/1.1 upstream that answers `101` to any request with an `Upgrade`
/// header and then goes on reading HTTP/1.1 requests on the same connection, as an
/// upstream that (rightly or wrongly) switched protocols might. Every request head
/// it reads is recorded; other requests get `200 ok`.
struct RawUpstream {
    addr: SocketAddr,
    heads: Arc<Mutex<Vec<String>>>,
}

impl RawUpstream {
    async fn start() -> RawUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let heads = Arc::new(Mutex::new(Vec::new()));
        let seen = heads.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let seen = seen.clone();
                tokio::spawn(async move {
                    // Bodies are never sent by these tests (Content-Length: 0).
                    while let Some(head) = read_head(&mut s).await {
                        let upgrade = head.to_ascii_lowercase().contains("\r\nupgrade:");
                        seen.lock().unwrap().push(head);
                        let reply: &[u8] = if upgrade {
                            b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: h2c\r\n\r\n"
                        } else {
                            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
                        };
                        if s.write_all(reply).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        RawUpstream { addr, heads }
    }

    fn heads(&self) -> Vec<String> {
        self.heads.lock().unwrap().clone()
    }
}

/// An upstream that counts its open connections (and the most ever open at once)
/// and answers every request `200 ok` after `delay`.
struct CountingUpstream {
    addr: SocketAddr,
    open: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
}

impl CountingUpstream {
    async fn start(delay: Duration) -> CountingUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (open, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (o, m) = (open.clone(), most.clone());
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                let now = o.fetch_add(1, Ordering::SeqCst) + 1;
                m.fetch_max(now, Ordering::SeqCst);
                let o = o.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |_req: Request<Incoming>| async move {
                        tokio::time::sleep(delay).await;
                        Ok::<_, std::convert::Infallible>(Response::new(Full::new(
                            Bytes::from_static(b"ok"),
                        )))
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(s), service)
                        .await;
                    o.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        CountingUpstream { addr, open, most }
    }

    fn most(&self) -> usize {
        self.most.load(Ordering::SeqCst)
    }
}

/// An upstream that sends a 200 head at once and then its body (`pieces` times
/// `piece`) one piece every `gap`: a long-running response.
async fn slow_body_upstream(piece: &'static [u8], pieces: usize, gap: Duration) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                while read_head(&mut s).await.is_some() {
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n",
                        piece.len() * pieces
                    );
                    if s.write_all(head.as_bytes()).await.is_err() {
                        return;
                    }
                    for _ in 0..pieces {
                        tokio::time::sleep(gap).await;
                        if s.write_all(piece).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    addr
}

fn proxy(target: SocketAddr, extra: &str) -> String {
    format!(
        r#"
upstreams:
  app: {{targets: ["http://{target}"], probe: false{extra}}}
routes:
  - name: login
    match: {{path: /login}}
    upstream: app
    limits: [{{algorithm: fixed_window, limit: 1, window: 1m}}]
  - {{name: rest, match: {{path_prefix: /}}, upstream: app}}
"#
    )
}

/// The status code of a response head.
fn status(head: &str) -> u16 {
    head.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not a response head: {head:?}"))
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.split("\r\n").skip(1).find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

// === upgrades and CONNECT ===

#[tokio::test]
async fn an_h2c_upgrade_is_not_spliced_and_the_requests_after_it_are_limited() {
    let up = RawUpstream::start().await;
    let gw = start_gateway(&proxy(up.addr, "")).await;
    let mut s = connect(gw.addr).await;
    let mut bytes = b"GET / HTTP/1.1\r\nhost: a\r\nconnection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\nhttp2-settings: AAMAAABkAAQAAP__\r\n\r\n".to_vec();
    for _ in 0..20 {
        bytes.extend_from_slice(b"POST /login HTTP/1.1\r\nhost: a\r\ncontent-length: 0\r\n\r\n");
    }
    s.write_all(&bytes).await.unwrap();
    let mut got = Vec::new();
    for _ in 0..21 {
        let (head, _) = read_response(&mut s).await.expect("a response");
        got.push(status(&head));
    }
    let mut want = vec![200, 200];
    want.extend([429; 19]);
    assert_eq!(got, want);
    // The upstream saw two plain requests: no upgrade, no HTTP2-Settings.
    let heads = up.heads();
    assert_eq!(heads.len(), 2, "{heads:?}");
    let first = heads[0].to_ascii_lowercase();
    assert!(first.starts_with("get / http/1.1\r\n"), "{first:?}");
    for h in ["upgrade", "http2-settings", "connection"] {
        assert_eq!(header(&first, h), None, "{h} forwarded: {first:?}");
    }
    assert!(
        heads[1].starts_with("POST /login HTTP/1.1\r\n"),
        "{heads:?}"
    );
    let m = metrics(gw.admin_addr).await;
    assert_eq!(
        decisions(&m, "login"),
        [("allowed", 1.0), ("limited", 19.0)]
    );
    assert_eq!(decisions(&m, "rest"), [("allowed", 1.0)]);
}

#[tokio::test]
async fn only_listed_upgrade_tokens_are_spliced() {
    let up = upstream().await;
    let target: SocketAddr = up.addr;
    let gw = start_gateway(&format!(
        "server: {{listen: \"127.0.0.1:0\", upgrades: [websocket, x-tunnel]}}\n{}",
        proxy(target, "")
    ))
    .await;
    // Listed, in any case: a 101 and a working tunnel.
    for token in ["WebSocket", "x-TUNNEL"] {
        let mut s = connect(gw.addr).await;
        let req = format!(
            "GET /ws HTTP/1.1\r\nhost: a\r\nconnection: upgrade\r\nupgrade: {token}\r\n\r\n"
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let head = read_head(&mut s).await.expect("an answer");
        assert_eq!(status(&head), 101, "{head:?}");
        assert_eq!(header(&head, "upgrade"), Some(token));
        s.write_all(b"ping").await.unwrap();
        let mut back = [0u8; 4];
        bounded("echo", s.read_exact(&mut back)).await.unwrap();
        assert_eq!(&back, b"ping");
    }
    // Not listed: forwarded as a plain request, the upgrade headers removed.
    let r = http1()
        .get(
            &url(gw.addr, "/ws"),
            &[("connection", "upgrade"), ("upgrade", "foo/1")],
        )
        .await;
    assert_eq!(r.status, 200);
    let echo = r.echo();
    assert_eq!(echo.header("upgrade"), None);
    assert_eq!(echo.header("connection"), None);
}

#[tokio::test]
async fn connect_is_refused_with_405_and_never_forwarded() {
    let up = RawUpstream::start().await;
    let gw = start_gateway(&proxy(up.addr, "")).await;
    let mut s = connect(gw.addr).await;
    s.write_all(b"CONNECT example.com:443 HTTP/1.1\r\nhost: example.com:443\r\n\r\n")
        .await
        .unwrap();
    let (head, body) = read_response(&mut s).await.expect("a response");
    assert_eq!(status(&head), 405, "{head:?}");
    assert_eq!(
        header(&head, "allow"),
        Some("GET, HEAD, POST, PUT, DELETE, PATCH, OPTIONS")
    );
    assert_eq!(body, "CONNECT is not supported\n");
    assert_eq!(up.heads().len(), 0);
    // Over h2c too.
    let r = h2c()
        .send(Method::CONNECT, &url(gw.addr, ""), &[], Bytes::new())
        .await;
    assert_eq!(r.status, 405);
    assert_eq!(up.heads().len(), 0);
    let m = metrics(gw.admin_addr).await;
    assert_eq!(decisions(&m, "unmatched"), [("bad_request", 2.0)]);
}

// === idle connections ===

/// A raw h2c connection that sends the preface and an empty SETTINGS frame, then
/// only acknowledges SETTINGS and PINGs. Resolves when the server closes it,
/// with whether a GOAWAY came first.
async fn idle_h2c(addr: SocketAddr) -> tokio::task::JoinHandle<bool> {
    let mut s = connect(addr).await;
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .unwrap();
    tokio::spawn(async move {
        let mut goaway = false;
        loop {
            let mut head = [0u8; 9];
            if s.read_exact(&mut head).await.is_err() {
                return goaway;
            }
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let mut payload = vec![0; len];
            if s.read_exact(&mut payload).await.is_err() {
                return goaway;
            }
            let (kind, flags) = (head[3], head[4]);
            let reply = match (kind, flags & 1) {
                (4, 0) => Some(b"\0\0\0\x04\x01\0\0\0\0".to_vec()),
                (6, 0) => {
                    let mut f = b"\0\0\x08\x06\x01\0\0\0\0".to_vec();
                    f.extend_from_slice(&payload);
                    Some(f)
                }
                (7, _) => {
                    goaway = true;
                    None
                }
                _ => None,
            };
            if let Some(r) = reply {
                if s.write_all(&r).await.is_err() {
                    return goaway;
                }
            }
        }
    })
}

#[tokio::test]
async fn idle_h2c_connections_are_closed_and_give_their_slots_back() {
    let up = upstream().await;
    let gw = start_gateway(&format!(
        "server: {{listen: \"127.0.0.1:0\", max_connections: 3, idle_timeout: 500ms}}\n{}",
        proxy(up.addr, "")
    ))
    .await;
    let mut idle = Vec::new();
    for _ in 0..3 {
        idle.push(idle_h2c(gw.addr).await);
    }
    for conn in idle {
        let goaway = bounded("idle h2c connection closed", conn).await.unwrap();
        assert!(goaway, "closed without a GOAWAY");
    }
    let r = http1().get(&url(gw.addr, "/"), &[]).await;
    assert_eq!(r.status, 200);
}

#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed() {
    let up = upstream().await;
    // A header timeout longer than the test's bound: only the idle timeout can
    // close the connection in time.
    let gw = start_gateway(&format!(
        "server: {{listen: \"127.0.0.1:0\", idle_timeout: 500ms, request_header_timeout: 60s}}\n{}",
        proxy(up.addr, "")
    ))
    .await;
    let mut s = connect(gw.addr).await;
    s.write_all(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    let (head, _) = read_response(&mut s).await.expect("a response");
    assert_eq!(status(&head), 200);
    assert_eq!(read_to_close(&mut s).await, "");
}

#[tokio::test]
async fn a_long_response_is_not_cut_by_the_idle_timeout() {
    let slow = slow_body_upstream(b"0123456789", 4, Duration::from_millis(400)).await;
    let gw = start_gateway(&format!(
        "server: {{listen: \"127.0.0.1:0\", idle_timeout: 500ms}}\n{}",
        proxy(slow, "")
    ))
    .await;
    let want = "0123456789".repeat(4);
    let (c1, c2, u) = (http1(), h2c(), url(gw.addr, "/slow"));
    let (a, b) = tokio::join!(c1.get(&u, &[]), c2.get(&u, &[]));
    for r in [a, b] {
        assert_eq!((r.status, r.text()), (200, want.as_str()));
    }
}

// === per-IP connection cap ===

/// Send a GET on `s`; the response status, or `None` when the connection closed.
async fn get_on(s: &mut TcpStream) -> Option<u16> {
    s.write_all(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .ok()?;
    read_response(s).await.map(|(head, _)| status(&head))
}

/// Open `n` connections to `addr`, each served a 200 on a GET, and keep them open.
async fn open_served(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    let mut open = Vec::new();
    for _ in 0..n {
        let mut s = connect(addr).await;
        assert_eq!(get_on(&mut s).await, Some(200));
        open.push(s);
    }
    open
}

/// Connect to `addr` again and again until a connection is served; its status.
async fn first_served_get(addr: SocketAddr, what: &str) -> u16 {
    bounded(what, async {
        loop {
            let mut s = connect(addr).await;
            if let Some(code) = get_on(&mut s).await {
                return code;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
}

#[tokio::test]
async fn a_peer_over_its_connection_cap_is_closed_at_once() {
    let up = upstream().await;
    let gw = start_gateway(&format!(
        "server: {{listen: \"127.0.0.1:0\", max_connections_per_ip: 3}}\n{}",
        proxy(up.addr, "")
    ))
    .await;
    let mut open = open_served(gw.addr, 3).await;
    let refused = "sluice_connections_refused_total{reason=\"per_ip\"}";
    assert_eq!(metric(&metrics(gw.admin_addr).await, refused), Some(0.0));
    let mut fourth = connect(gw.addr).await;
    assert_eq!(get_on(&mut fourth).await, None);
    assert_eq!(metric(&metrics(gw.admin_addr).await, refused), Some(1.0));
    // The three are still served.
    for s in &mut open {
        assert_eq!(get_on(s).await, Some(200));
    }
    // One closes: a new connection is accepted once the gateway has seen it go.
    drop(open.pop());
    let served = first_served_get(gw.addr, "a connection accepted after one closed").await;
    assert_eq!(served, 200);
}

#[tokio::test]
async fn trusted_proxies_are_exempt_from_the_per_ip_cap() {
    let up = upstream().await;
    let gw = start_gateway(&format!(
        "server: {{listen: \"127.0.0.1:0\", max_connections_per_ip: 1}}\nclient_ip: {{trusted_proxies: [127.0.0.1/32]}}\n{}",
        proxy(up.addr, "")
    ))
    .await;
    let _open = open_served(gw.addr, 3).await;
}

// === request heads ===

/// A GET whose head is exactly `size` bytes long (padded with `x-pad`).
fn head_of(size: usize) -> Vec<u8> {
    let start = b"GET / HTTP/1.1\r\nhost: a\r\nx-pad: ";
    let end = b"\r\n\r\n";
    let mut v = start.to_vec();
    v.extend(std::iter::repeat_n(b'p', size - start.len() - end.len()));
    v.extend_from_slice(end);
    assert_eq!(v.len(), size);
    v
}

#[tokio::test]
async fn a_request_head_over_max_header_bytes_is_431_and_closes() {
    let up = upstream().await;
    let gw = start_gateway(&proxy(up.addr, "")).await;
    // Default: 32KiB for the whole head.
    let mut s = connect(gw.addr).await;
    s.write_all(&head_of(32 * 1024)).await.unwrap();
    let (head, body) = read_response(&mut s).await.expect("a response");
    assert_eq!(status(&head), 200, "{head:?}");
    let pad: serde_json::Value = serde_json::from_str(&body).unwrap();
    let sent_pad = pad["headers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h[0] == "x-pad")
        .map(|h| h[1].as_str().unwrap().len());
    assert_eq!(sent_pad, Some(32 * 1024 - 36));

    let mut s = connect(gw.addr).await;
    s.write_all(&head_of(32 * 1024 + 1)).await.unwrap();
    let (head, _) = read_response(&mut s).await.expect("a response");
    assert!(
        head.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"),
        "{head:?}"
    );
    assert_eq!(read_to_close(&mut s).await, "");
    assert_eq!(up.hits(), 1);
}

#[tokio::test]
async fn a_slow_oversized_head_is_cut_at_the_limit() {
    let up = upstream().await;
    let gw = start_gateway(&proxy(up.addr, "")).await;
    let s = connect(gw.addr).await;
    let (mut r, mut w) = s.into_split();
    let answered = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = answered.clone();
    let reader = tokio::spawn(async move {
        let mut buf = Vec::new();
        let mut byte = [0u8; 1];
        while !buf.ends_with(b"\r\n\r\n") {
            match r.read(&mut byte).await {
                Ok(1) => buf.push(byte[0]),
                _ => break,
            }
        }
        flag.store(true, Ordering::SeqCst);
        String::from_utf8_lossy(&buf).into_owned()
    });
    // 128KiB of a head that never ends, 1KiB at a time.
    const TOTAL: usize = 128 * 1024;
    let mut sent = 0;
    w.write_all(b"GET / HTTP/1.1\r\nhost: a\r\nx-pad: ")
        .await
        .unwrap();
    while sent < TOTAL && !answered.load(Ordering::SeqCst) {
        if w.write_all(&[b'p'; 1024]).await.is_err() {
            break;
        }
        sent += 1024;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let head = bounded("the 431", reader).await.unwrap();
    assert!(head.starts_with("HTTP/1.1 431 "), "{head:?}");
    assert!(
        sent < TOTAL,
        "the whole {TOTAL} bytes were taken before the answer"
    );
    assert_eq!(up.hits(), 0);
}

#[tokio::test]
async fn an_h2_header_list_over_max_header_bytes_is_431() {
    let up = upstream().await;
    let gw = start_gateway(&proxy(up.addr, "")).await;
    let client = h2c();
    let small = "p".repeat(16 * 1024);
    let r = client.get(&url(gw.addr, "/"), &[("x-pad", &small)]).await;
    assert_eq!(r.status, 200);
    let big = "p".repeat(40 * 1024);
    let r = client.get(&url(gw.addr, "/"), &[("x-pad", &big)]).await;
    assert_eq!(r.status, 431);
    // The stream was refused, not the connection.
    let r = client.get(&url(gw.addr, "/"), &[]).await;
    assert_eq!(r.status, 200);
    assert_eq!(up.hits(), 2);
}

// === upstream connection cap ===

/// `n` GETs of `u` sent at once on `client`; the responses, in the order sent.
async fn concurrent_gets(client: &HttpClient, u: &str, n: usize) -> Vec<Resp> {
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (client, u) = (client.clone(), u.to_string());
            tokio::spawn(async move { client.get(&u, &[]).await })
        })
        .collect();
    let mut got = Vec::new();
    for t in tasks {
        got.push(t.await.unwrap());
    }
    got
}

/// `sluice_upstream_errors_total` for a full upstream on the route `rest`.
fn busy_errors(m: &str) -> Option<f64> {
    metric(
        m,
        "sluice_upstream_errors_total{kind=\"busy\",route=\"rest\"}",
    )
}

#[tokio::test]
async fn an_h2c_client_opens_no_more_upstream_connections_than_the_cap() {
    let up = CountingUpstream::start(Duration::from_millis(20)).await;
    let gw = start_gateway(&proxy(
        up.addr,
        ", max_connections: 10, connect_timeout: 10s",
    ))
    .await;
    let client = h2c();
    let u = url(gw.addr, "/x");
    let statuses: Vec<u16> = concurrent_gets(&client, &u, 200)
        .await
        .iter()
        .map(|r| r.status)
        .collect();
    assert_eq!(statuses, vec![200; 200]);
    assert!(
        up.most() <= 10,
        "{} upstream connections at once",
        up.most()
    );
    assert!(up.open.load(Ordering::SeqCst) <= 10);
    let m = metrics(gw.admin_addr).await;
    assert_eq!(busy_errors(&m), Some(0.0));
}

#[tokio::test]
async fn requests_over_the_upstream_cap_wait_then_get_503() {
    let up = CountingUpstream::start(Duration::from_millis(1500)).await;
    let gw = start_gateway(&proxy(
        up.addr,
        ", max_connections: 2, connect_timeout: 200ms",
    ))
    .await;
    let client = h2c();
    let u = url(gw.addr, "/x");
    let mut got: Vec<_> = concurrent_gets(&client, &u, 6)
        .await
        .iter()
        .map(|r| (r.status, r.text().to_string()))
        .collect();
    got.sort();
    let mut want = vec![(200, "ok".to_string()); 2];
    want.extend(vec![(503, "upstream busy\n".to_string()); 4]);
    assert_eq!(got, want);
    assert_eq!(up.most(), 2);
    let m = metrics(gw.admin_addr).await;
    assert_eq!(busy_errors(&m), Some(4.0));
}

// === the open-file limit ===

/// The real binary, in its own process group, killed (group and all) on drop.
struct Process(std::process::Child);

impl Drop for Process {
    fn drop(&mut self) {
        unsafe {
            libc::killpg(self.0.id() as i32, libc::SIGKILL);
        }
        let _ = self.0.wait();
    }
}

/// `(soft, hard)` of "Max open files" in /proc/PID/limits.
fn open_files(pid: u32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let mut f = line["Max open files".len()..].split_whitespace();
    (f.next().unwrap().into(), f.next().unwrap().into())
}

#[tokio::test]
async fn the_open_file_limit_is_raised_to_its_hard_limit() {
    use std::os::unix::process::CommandExt;
    let (port, admin) = (free_port(), free_port());
    let config = config_file(&format!(
        "server: {{listen: \"127.0.0.1:{port}\"}}\nadmin: {{listen: \"127.0.0.1:{admin}\"}}\nroutes:\n  - {{name: hi, respond: {{body: hi}}}}\n"
    ));
    let child = std::process::Command::new("sh")
        .arg("-c")
        .arg("ulimit -Sn 256 && exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_sluice"))
        .args(["run", "-c"])
        .arg(config.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn()
        .unwrap();
    let p = Process(child);
    let gw: SocketAddr = ([127, 0, 0, 1], port).into();
    let served = bounded("sluice comes up", async {
        loop {
            if let Ok(r) = http1()
                .try_send(Method::GET, &url(gw, "/"), &[], Bytes::new())
                .await
            {
                return r.status;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert_eq!(served, 200);
    let (soft, hard) = open_files(p.0.id());
    assert_eq!(soft, hard, "soft limit left at {soft}");
    assert_ne!(soft, "256");
}

#[tokio::test]
async fn an_upgraded_tunnel_keeps_its_connection_slot() {
    let up = upstream().await;
    let gw = start_gateway(&format!(
        "server: {{listen: \"127.0.0.1:0\", max_connections_per_ip: 2}}\n{}",
        proxy(up.addr, "")
    ))
    .await;
    let mut tunnel = connect(gw.addr).await;
    tunnel
        .write_all(
            b"GET /ws HTTP/1.1\r\nhost: a\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n",
        )
        .await
        .unwrap();
    let head = read_head(&mut tunnel).await.expect("an answer");
    assert_eq!(status(&head), 101, "{head:?}");
    tunnel.write_all(b"ping").await.unwrap();
    let mut back = [0u8; 4];
    bounded("echo", tunnel.read_exact(&mut back)).await.unwrap();
    let mut second = connect(gw.addr).await;
    assert_eq!(get_on(&mut second).await, Some(200));
    let mut third = connect(gw.addr).await;
    assert_eq!(get_on(&mut third).await, None);
    // The tunnel closes: its slot comes back.
    tunnel.shutdown().await.unwrap();
    assert_eq!(read_to_close(&mut tunnel).await, "");
    drop(tunnel);
    let served = first_served_get(gw.addr, "a connection accepted after the tunnel closed").await;
    assert_eq!(served, 200);
}

/// A reload keeps an unchanged upstream, pool and cap included: connections in use
/// when it happens still count. A changed cap builds a new upstream.
#[tokio::test]
async fn a_reload_keeps_the_upstream_connection_cap_unless_it_changes() {
    let up = CountingUpstream::start(Duration::from_millis(1500)).await;
    let one = proxy(up.addr, ", max_connections: 1, connect_timeout: 200ms");
    let (gw, file) = start_gateway_file(&one).await;
    let client = h2c();
    let u = url(gw.addr, "/x");
    let first = {
        let (client, u) = (client.clone(), u.clone());
        tokio::spawn(async move { client.get(&u, &[]).await.status })
    };
    let open = up.open.clone();
    assert!(
        eventually(Duration::from_secs(2), || {
            let open = open.clone();
            async move { open.load(Ordering::SeqCst) == 1 }
        })
        .await
        .is_some(),
        "the first request never reached the upstream"
    );
    gw.reload().await.unwrap();
    let second = client.get(&u, &[]).await;
    assert_eq!((second.status, second.text()), (503, "upstream busy\n"));
    assert_eq!(first.await.unwrap(), 200);
    assert_eq!(up.most(), 1);

    std::fs::write(
        file.path(),
        with_listeners(&proxy(
            up.addr,
            ", max_connections: 2, connect_timeout: 200ms",
        )),
    )
    .unwrap();
    gw.reload().await.unwrap();
    let got: Vec<u16> = concurrent_gets(&client, &u, 2)
        .await
        .iter()
        .map(|r| r.status)
        .collect();
    assert_eq!(got, [200, 200]);
}

// === slow request bodies and the upstream connection cap ===

/// An upstream that counts the connections it accepts and the request heads it
/// gets, reads each body to its end and answers with its length.
struct LengthUpstream {
    addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
    heads: Arc<AtomicUsize>,
}

impl LengthUpstream {
    async fn start() -> LengthUpstream {
        use http_body_util::BodyExt;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (accepted, heads) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (a, h) = (accepted.clone(), heads.clone());
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                a.fetch_add(1, Ordering::SeqCst);
                let h = h.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req: Request<Incoming>| {
                        h.fetch_add(1, Ordering::SeqCst);
                        async move {
                            let len = match req.into_body().collect().await {
                                Ok(b) => b.to_bytes().len().to_string(),
                                Err(e) => format!("body failed: {e}"),
                            };
                            Ok::<_, std::convert::Infallible>(Response::new(Full::new(
                                Bytes::from(len),
                            )))
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(s), service)
                        .await;
                });
            }
        });
        LengthUpstream {
            addr,
            accepted,
            heads,
        }
    }

    fn counts(&self) -> (usize, usize) {
        (
            self.accepted.load(Ordering::SeqCst),
            self.heads.load(Ordering::SeqCst),
        )
    }
}

/// The pace of a slow body: 100 bytes, one every 200ms.
const SLOW_BYTES: usize = 100;
const SLOW_GAP: Duration = Duration::from_millis(200);

/// A request body sent one byte every `SLOW_GAP`.
/// Tells `started` once three bytes are out.
struct Trickle {
    left: usize,
    next: std::pin::Pin<Box<tokio::time::Sleep>>,
    started: Option<tokio::sync::mpsc::Sender<()>>,
}

impl Trickle {
    fn new(started: tokio::sync::mpsc::Sender<()>) -> Trickle {
        Trickle {
            left: SLOW_BYTES,
            next: Box::pin(tokio::time::sleep(Duration::ZERO)),
            started: Some(started),
        }
    }
}

impl http_body::Body for Trickle {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        if self.left == 0 {
            return std::task::Poll::Ready(None);
        }
        std::task::ready!(std::future::Future::poll(self.next.as_mut(), cx));
        if self.left == SLOW_BYTES - 3 {
            if let Some(started) = self.started.take() {
                let _ = started.try_send(());
            }
        }
        self.next
            .as_mut()
            .reset(tokio::time::Instant::now() + SLOW_GAP);
        self.left -= 1;
        std::task::Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::from_static(b"x")))))
    }

    fn is_end_stream(&self) -> bool {
        self.left == 0
    }
}

/// An HTTP/1.1 upload from 127.0.0.2 at `SLOW_GAP` a byte; tells `started` once
/// three bytes are out; the answer's status and body. `head` is added to the
/// request head; `first` is sent with it, before the trickle.
async fn slow_upload(
    addr: SocketAddr,
    started: tokio::sync::mpsc::Sender<()>,
    head: &'static str,
    first: &'static [u8],
) -> (u16, String) {
    let mut s = connect_from_other(addr).await;
    let length = first.len() + SLOW_BYTES;
    s.write_all(
        format!("POST /slow HTTP/1.1\r\nhost: a\r\ncontent-length: {length}\r\n{head}\r\n")
            .as_bytes(),
    )
    .await
    .expect("write head");
    s.write_all(first).await.expect("write the first bytes");
    for i in 0..SLOW_BYTES {
        s.write_all(b"x").await.expect("write a byte");
        if i == 2 {
            let _ = started.send(()).await;
        }
        tokio::time::sleep(SLOW_GAP).await;
    }
    let (head, body) = read_response(&mut s).await.expect("an answer");
    (status(&head), body)
}

/// While slow uploads trickle, a quick request from 127.0.0.1 (a small body sent
/// with its head) gets 200, and it alone has reached the upstream.
async fn assert_the_victim_is_served(gw: SocketAddr, up: &LengthUpstream) {
    assert_the_victim_is_served_beside(gw, up, 0).await
}

/// As `assert_the_victim_is_served`, with `held` slow uploads already holding an
/// upstream connection each.
async fn assert_the_victim_is_served_beside(gw: SocketAddr, up: &LengthUpstream, held: usize) {
    let got = exchange(
        gw,
        b"POST /victim HTTP/1.1\r\nhost: a\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello",
    )
    .await;
    assert!(got.starts_with("HTTP/1.1 200 OK\r\n"), "{got}");
    assert!(got.ends_with("\r\n\r\n5"), "{got}");
    assert_eq!(up.counts(), (held + 1, held + 1));
}

/// `n` slow HTTP/1.1 uploads from 127.0.0.2 (`slow_upload`), once each has started.
async fn slow_uploads(
    gw: SocketAddr,
    n: usize,
    head: &'static str,
    first: &'static [u8],
) -> Vec<tokio::task::JoinHandle<(u16, String)>> {
    let (tx, mut started) = tokio::sync::mpsc::channel(n);
    let slow = (0..n)
        .map(|_| tokio::spawn(slow_upload(gw, tx.clone(), head, first)))
        .collect();
    for _ in 0..n {
        bounded("slow uploads start", started.recv()).await;
    }
    slow
}

/// `n` slow requests (`Trickle` bodies) on one h2c connection from 127.0.0.2,
/// with `headers`; each tells `started` once three bytes are out.
async fn slow_h2c_requests(
    gw: SocketAddr,
    n: usize,
    headers: &[(&str, &str)],
    started: tokio::sync::mpsc::Sender<()>,
) -> Vec<tokio::task::JoinHandle<(u16, String)>> {
    use http_body_util::BodyExt;
    let stream = connect_from_other(gw).await;
    let (send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        TokioIo::new(stream),
    )
    .await
    .expect("h2c handshake");
    tokio::spawn(conn);
    (0..n)
        .map(|_| {
            let mut send = send.clone();
            let mut req = Request::post(format!("http://{gw}/slow"))
                .header("content-length", SLOW_BYTES.to_string());
            for (k, v) in headers {
                req = req.header(*k, *v);
            }
            let req = req.body(Trickle::new(started.clone())).expect("request");
            tokio::spawn(async move {
                let resp = send.send_request(req).await.expect("an answer");
                let status = resp.status().as_u16();
                let body = resp.into_body().collect().await.expect("body").to_bytes();
                (status, String::from_utf8_lossy(&body).into_owned())
            })
        })
        .collect()
}

/// The answers of `tasks`, sorted.
async fn answers_of(tasks: Vec<tokio::task::JoinHandle<(u16, String)>>) -> Vec<(u16, String)> {
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(bounded("a slow request's answer", t).await.expect("task"));
    }
    answers.sort();
    answers
}

#[tokio::test]
async fn slow_uploads_hold_no_upstream_connection_while_their_body_trickles() {
    let up = LengthUpstream::start().await;
    let gw = start_gateway(&proxy(up.addr, ", max_connections: 4, connect_timeout: 1s")).await;
    let slow = slow_uploads(gw.addr, 4, "", b"").await;
    assert_the_victim_is_served(gw.addr, &up).await;
    assert_eq!(
        answers_of(slow).await,
        vec![(200, SLOW_BYTES.to_string()); 4]
    );
    let (accepted, heads) = up.counts();
    assert_eq!(heads, 5);
    assert!(
        (1..=4).contains(&accepted),
        "{accepted} upstream connections"
    );
}

#[tokio::test]
async fn slow_h2c_streams_hold_no_upstream_connection_while_their_bodies_trickle() {
    let up = LengthUpstream::start().await;
    let gw = start_gateway(&proxy(up.addr, ", max_connections: 4, connect_timeout: 1s")).await;
    let (tx, mut started) = tokio::sync::mpsc::channel(6);
    let slow = slow_h2c_requests(gw.addr, 6, &[], tx).await;
    for _ in 0..6 {
        bounded("slow streams start", started.recv()).await;
    }
    assert_the_victim_is_served(gw.addr, &up).await;
    assert_eq!(
        answers_of(slow).await,
        vec![(200, SLOW_BYTES.to_string()); 6]
    );
    let (accepted, heads) = up.counts();
    assert_eq!(heads, 7);
    assert!(
        (1..=4).contains(&accepted),
        "{accepted} upstream connections"
    );
}

/// A gRPC content type over HTTP/1.1 is no gRPC call (gRPC is HTTP/2 only): its
/// body is read ahead like any other, so it cannot be used to step around the
/// read-ahead and take every upstream connection.
#[tokio::test]
async fn a_grpc_content_type_over_http1_is_read_ahead_like_any_upload() {
    let up = LengthUpstream::start().await;
    let gw = start_gateway(&proxy(up.addr, ", max_connections: 4, connect_timeout: 1s")).await;
    let slow = slow_uploads(gw.addr, 4, "content-type: application/grpc\r\n", b"").await;
    assert_the_victim_is_served(gw.addr, &up).await;
    assert_eq!(
        answers_of(slow).await,
        vec![(200, SLOW_BYTES.to_string()); 4]
    );
}

/// Uploads that still stream when they take an upstream connection (past
/// `request_buffer` here) hold at most a quarter of the upstream's connections per
/// client address: one of four here; the others get 503 and the victim, from
/// another address, is served.
#[tokio::test]
async fn uploads_past_the_read_ahead_hold_a_quarter_of_the_connections_per_client() {
    let up = LengthUpstream::start().await;
    let config = format!(
        "server: {{listen: \"127.0.0.1:0\", request_buffer: 1KiB}}\n{}",
        proxy(up.addr, ", max_connections: 4, connect_timeout: 1s")
    );
    let gw = start_gateway(&config).await;
    static FIRST: [u8; 2048] = [b'y'; 2048];
    let slow = slow_uploads(gw.addr, 4, "", &FIRST).await;
    assert_the_victim_is_served_beside(gw.addr, &up, 1).await;
    let busy = (503, "upstream busy\n".to_string());
    let whole = (200, (FIRST.len() + SLOW_BYTES).to_string());
    assert_eq!(
        answers_of(slow).await,
        vec![whole, busy.clone(), busy.clone(), busy]
    );
    let m = metrics(gw.admin_addr).await;
    assert_eq!(
        metric(
            &m,
            "sluice_upstream_errors_total{kind=\"busy\",route=\"rest\"}"
        ),
        Some(3.0),
        "{m}"
    );
}

/// gRPC calls over h2c are not read ahead (their messages go both ways at once),
/// so they are the uploads the per-client share is for: six slow calls of one
/// client get one upstream connection and five refusals, and the victim is served.
/// The refusals are gRPC's (`UNAVAILABLE`, HTTP 200 with no body), counted as busy.
#[tokio::test]
async fn slow_grpc_calls_of_one_client_hold_a_quarter_of_the_connections() {
    let up = LengthUpstream::start().await;
    let gw = start_gateway(&proxy(up.addr, ", max_connections: 4, connect_timeout: 1s")).await;
    // The refused calls may never say they started: nobody waits for them to.
    let (tx, _started) = tokio::sync::mpsc::channel(6);
    let grpc = [("content-type", "application/grpc")];
    let slow = slow_h2c_requests(gw.addr, 6, &grpc, tx).await;
    // One call takes the client's one connection (its head reaches the upstream).
    let holding = eventually(Duration::from_secs(5), || async { up.counts() == (1, 1) }).await;
    assert!(holding.is_some(), "{:?}", up.counts());
    assert_the_victim_is_served_beside(gw.addr, &up, 1).await;
    let busy = (200, String::new());
    let mut expected = vec![(200, SLOW_BYTES.to_string())];
    expected.extend(std::iter::repeat_n(busy, 5));
    let mut answers = answers_of(slow).await;
    answers.sort();
    expected.sort();
    assert_eq!(answers, expected);
    let m = metrics(gw.admin_addr).await;
    assert_eq!(
        metric(
            &m,
            "sluice_upstream_errors_total{kind=\"busy\",route=\"rest\"}"
        ),
        Some(5.0),
        "{m}"
    );
}

/// A WebSocket tunnel holds its upstream connection for as long as the client
/// keeps it open: one address may hold a quarter of the upstream's connections
/// with tunnels (one of four here). Its next upgrade gets 503, another address's
/// gets its tunnel, and the share comes back when the tunnel closes.
#[tokio::test]
async fn tunnels_of_one_client_hold_a_quarter_of_the_connections() {
    const UPGRADE: &[u8] =
        b"GET /ws HTTP/1.1\r\nhost: a\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n";
    let up = upstream().await;
    let gw = start_gateway(&proxy(up.addr, ", max_connections: 4, connect_timeout: 1s")).await;
    let mut first = connect_from_other(gw.addr).await;
    first.write_all(UPGRADE).await.unwrap();
    let head = read_head(&mut first).await.expect("an answer");
    assert_eq!(status(&head), 101, "{head}");
    let mut second = connect_from_other(gw.addr).await;
    second.write_all(UPGRADE).await.unwrap();
    let (head, body) = read_response(&mut second).await.expect("an answer");
    assert_eq!((status(&head), body.as_str()), (503, "upstream busy\n"));
    let m = metrics(gw.admin_addr).await;
    assert_eq!(
        metric(
            &m,
            "sluice_upstream_errors_total{kind=\"busy\",route=\"rest\"}"
        ),
        Some(1.0),
        "{m}"
    );
    let mut victim = connect(gw.addr).await;
    victim.write_all(UPGRADE).await.unwrap();
    let head = read_head(&mut victim).await.expect("an answer");
    assert_eq!(status(&head), 101, "{head}");
    victim.write_all(b"ping").await.unwrap();
    let mut back = [0u8; 4];
    bounded("echo", victim.read_exact(&mut back)).await.unwrap();
    assert_eq!(&back, b"ping");
    // The first tunnel closes: its share comes back.
    first.shutdown().await.unwrap();
    assert_eq!(read_to_close(&mut first).await, "");
    drop(first);
    let again = eventually(Duration::from_secs(5), || async {
        let mut s = connect_from_other(gw.addr).await;
        s.write_all(UPGRADE).await.unwrap();
        read_head(&mut s).await.is_some_and(|h| status(&h) == 101)
    })
    .await;
    assert!(again.is_some(), "no tunnel after the first closed");
}
