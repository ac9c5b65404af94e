//! The `concurrency` algorithm end to end: at most `limit` requests of a key in
//! flight, a slot held until the response body ends or the client goes away, on the
//! memory store and on Redis (where a slot is a lease that expires when the instance
//! holding it dies). The decision and duration of a request are recorded when its
//! body ends, not when its head is sent.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Frame;
use http_body_util::StreamBody;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use crate::common::redis::{
    cluster_target, redis_store, url_target, RedisCluster, RedisServer, SluiceProcess,
};
use crate::common::*;

/// The body of one response the upstream is sending: each `send` is a chunk; dropping
/// it ends the body.
type Tap = mpsc::Sender<Bytes>;

/// An upstream whose responses (200, streamed) end only when the test says so: every
/// request hands the test its `Tap`.
struct Slow {
    addr: SocketAddr,
    taps: mpsc::UnboundedReceiver<Tap>,
}

impl Slow {
    async fn next_tap(&mut self) -> Tap {
        bounded("a request at the upstream", self.taps.recv())
            .await
            .expect("upstream running")
    }
}

async fn slow_upstream() -> Slow {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, taps) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let service = service_fn(move |_req: Request<Incoming>| {
                    let tx = tx.clone();
                    async move {
                        let (tap, rx) = mpsc::channel::<Bytes>(4);
                        let _ = tx.send(tap);
                        let frames = futures_util::stream::unfold(rx, |mut rx| async move {
                            let chunk = rx.recv().await?;
                            Some((Ok::<_, Infallible>(Frame::data(chunk)), rx))
                        });
                        Ok::<_, Infallible>(Response::new(StreamBody::new(frames)))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Slow { addr, taps }
}

fn config(up: &Slow, store: &str) -> String {
    format!(
        "{store}upstreams:\n  slow: {{targets: [\"http://{}\"]}}\nroutes:\n  - name: slow\n    match: {{path_prefix: /}}\n    upstream: slow\n    key: header:x-key\n    limits: [{{name: inflight, algorithm: concurrency, limit: 2, lease: 2s}}]\n",
        up.addr
    )
}

/// Like `config`, with one slot a key and leases of `lease`.
fn one_slot_config(up: &Slow, store: &str, lease: &str) -> String {
    format!(
        "{store}upstreams:\n  slow: {{targets: [\"http://{}\"]}}\nroutes:\n  - name: slow\n    match: {{path_prefix: /}}\n    upstream: slow\n    key: header:x-key\n    limits: [{{name: inflight, algorithm: concurrency, limit: 1, lease: {lease}}}]\n",
        up.addr
    )
}

/// Sends a GET for `key` on a connection of its own and reads the response head.
async fn open(addr: SocketAddr, key: &str) -> (TcpStream, String) {
    let mut s = connect(addr).await;
    let req = format!("GET /stream HTTP/1.1\r\nHost: a\r\nx-key: {key}\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let head = read_head(&mut s).await.expect("a response head");
    (s, head)
}

/// Three requests of key `k` under a limit of 2: the first two pass and hold their
/// slots, the third gets 429. The first one's client and tap, then what keeps the
/// other two open.
async fn two_pass_and_a_third_is_limited(
    addr: SocketAddr,
    up: &mut Slow,
) -> (TcpStream, Tap, (TcpStream, Tap, TcpStream)) {
    let (c1, h1) = open(addr, "k").await;
    let t1 = up.next_tap().await;
    let (c2, h2) = open(addr, "k").await;
    let t2 = up.next_tap().await;
    let (c3, h3) = open(addr, "k").await;
    assert_eq!(
        [status(&h1), status(&h2), status(&h3)],
        [
            "HTTP/1.1 200 OK",
            "HTTP/1.1 200 OK",
            "HTTP/1.1 429 Too Many Requests"
        ]
    );
    (c1, t1, (c2, t2, c3))
}

/// Requests of key `k`, `gap` apart, at most `tries` of them, until one passes; its
/// connection (still open), or `None` if none did.
async fn passes_within(addr: SocketAddr, tries: usize, gap: Duration) -> Option<TcpStream> {
    for _ in 0..tries {
        let (c, h) = open(addr, "k").await;
        if status(&h) == "HTTP/1.1 200 OK" {
            return Some(c);
        }
        tokio::time::sleep(gap).await;
    }
    None
}

fn status(head: &str) -> &str {
    head.lines().next().unwrap_or_default()
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// The request counts and the duration histogram's count of route `slow`.
fn counted(text: &str) -> [u64; 3] {
    let m = |s: &str| metric(text, s).unwrap_or(-1.0) as u64;
    [
        m("sluice_requests_total{decision=\"allowed\",route=\"slow\"}"),
        m("sluice_requests_total{decision=\"limited\",route=\"slow\"}"),
        m("sluice_request_duration_seconds_count{route=\"slow\"}"),
    ]
}

/// Waits (bounded) until `counted` is `want`; returns the last seen.
async fn counted_eventually(admin: SocketAddr, want: [u64; 3]) -> [u64; 3] {
    let mut last = [0; 3];
    for _ in 0..200 {
        last = counted(&metrics(admin).await);
        if last == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    last
}

/// Ends a streamed response: one last chunk, then the end; the client reads it all.
async fn finish(tap: Tap, client: &mut TcpStream) -> String {
    tap.send(Bytes::from("done\n")).await.expect("body open");
    drop(tap);
    let mut body = String::new();
    loop {
        let line = read_line(client).await;
        let size = usize::from_str_radix(line.trim(), 16).expect("chunk size");
        let mut chunk = vec![0; size + 2];
        bounded(
            "read chunk",
            tokio::io::AsyncReadExt::read_exact(client, &mut chunk),
        )
        .await
        .expect("chunk");
        if size == 0 {
            return body;
        }
        body.push_str(&String::from_utf8_lossy(&chunk[..size]));
    }
}

async fn read_line(s: &mut TcpStream) -> String {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while !line.ends_with(b"\r\n") {
        let n = bounded("read line", tokio::io::AsyncReadExt::read(s, &mut b))
            .await
            .expect("read");
        assert_eq!(n, 1, "connection closed mid-line");
        line.push(b[0]);
    }
    String::from_utf8_lossy(&line).into_owned()
}

/// Two in flight pass, the third gets 429 (Retry-After: 1, remaining 0), another key
/// is not affected; after one body ends the next passes. Nothing is counted while
/// the bodies stream; each request is counted once, when its body ends.
async fn slots_are_held_until_the_body_ends(store: &str, release: impl AsyncFn()) {
    let mut up = slow_upstream().await;
    let gw = start_gateway(&config(&up, store)).await;
    let (mut c1, h1) = open(gw.addr, "k").await;
    let t1 = up.next_tap().await;
    assert_eq!(status(&h1), "HTTP/1.1 200 OK", "{h1}");
    assert_eq!(header(&h1, "x-ratelimit-remaining"), Some("1"), "{h1}");
    assert_eq!(header(&h1, "x-ratelimit-limit"), Some("2"), "{h1}");
    let (mut c2, h2) = open(gw.addr, "k").await;
    let t2 = up.next_tap().await;
    assert_eq!(status(&h2), "HTTP/1.1 200 OK", "{h2}");
    assert_eq!(header(&h2, "x-ratelimit-remaining"), Some("0"), "{h2}");
    assert_eq!(header(&h2, "x-ratelimit-reset"), Some("0"), "{h2}");

    let (_c3, h3) = open(gw.addr, "k").await;
    assert_eq!(status(&h3), "HTTP/1.1 429 Too Many Requests", "{h3}");
    assert_eq!(header(&h3, "retry-after"), Some("1"), "{h3}");
    assert_eq!(header(&h3, "x-ratelimit-remaining"), Some("0"), "{h3}");
    assert_eq!(header(&h3, "x-ratelimit-reset"), Some("1"), "{h3}");
    assert_eq!(
        header(&h3, "ratelimit-policy"),
        Some("\"inflight\";q=2"),
        "{h3}"
    );
    // Another key has its own slots.
    let (mut other, ho) = open(gw.addr, "other").await;
    let to = up.next_tap().await;
    assert_eq!(status(&ho), "HTTP/1.1 200 OK", "{ho}");
    assert_eq!(finish(to, &mut other).await, "done\n");

    // The 429 and `other` ended; the two of `k` still stream: not counted yet.
    assert_eq!(
        counted_eventually(gw.admin_addr, [1, 1, 2]).await,
        [1, 1, 2]
    );
    t2.send(Bytes::from("partial\n")).await.expect("body open");
    assert_eq!(counted(&metrics(gw.admin_addr).await), [1, 1, 2]);

    assert_eq!(finish(t1, &mut c1).await, "done\n");
    assert_eq!(
        counted_eventually(gw.admin_addr, [2, 1, 3]).await,
        [2, 1, 3]
    );
    release().await;
    let (mut c4, h4) = open(gw.addr, "k").await;
    assert_eq!(status(&h4), "HTTP/1.1 200 OK", "{h4}");
    let t4 = up.next_tap().await;
    // Still two in flight (2 and 4).
    let (_c5, h5) = open(gw.addr, "k").await;
    assert_eq!(status(&h5), "HTTP/1.1 429 Too Many Requests", "{h5}");

    assert_eq!(finish(t2, &mut c2).await, "partial\ndone\n");
    assert_eq!(finish(t4, &mut c4).await, "done\n");
    assert_eq!(
        counted_eventually(gw.admin_addr, [4, 2, 6]).await,
        [4, 2, 6]
    );
}

/// A client that goes away mid-response gives its slot back (and is counted then).
async fn a_client_that_goes_away_releases_its_slot(store: &str, release: impl AsyncFn()) {
    let mut up = slow_upstream().await;
    let gw = start_gateway(&config(&up, store)).await;
    let (c1, h1) = open(gw.addr, "k").await;
    let t1 = up.next_tap().await;
    let (_c2, h2) = open(gw.addr, "k").await;
    let _t2 = up.next_tap().await;
    assert_eq!(
        (status(&h1), status(&h2)),
        ("HTTP/1.1 200 OK", "HTTP/1.1 200 OK")
    );
    let (_c3, h3) = open(gw.addr, "k").await;
    assert_eq!(status(&h3), "HTTP/1.1 429 Too Many Requests", "{h3}");
    assert_eq!(counted(&metrics(gw.admin_addr).await), [0, 1, 1]);

    drop(c1);
    // The next chunk finds the client gone (if the close was not noticed already).
    let _ = t1.send(Bytes::from("anyone?\n")).await;
    assert_eq!(
        counted_eventually(gw.admin_addr, [1, 1, 2]).await,
        [1, 1, 2]
    );
    release().await;
    let (_c4, h4) = open(gw.addr, "k").await;
    assert_eq!(status(&h4), "HTTP/1.1 200 OK", "{h4}");
}

async fn nothing() {}

#[tokio::test]
async fn memory_slots_are_held_until_the_body_ends() {
    slots_are_held_until_the_body_ends("", nothing).await;
}

#[tokio::test]
async fn memory_a_client_that_goes_away_releases_its_slot() {
    a_client_that_goes_away_releases_its_slot("", nothing).await;
}

#[tokio::test]
async fn a_refusal_by_another_limit_takes_no_slot_and_a_full_slot_charges_nothing() {
    let mut up = slow_upstream().await;
    let yaml = format!(
        "upstreams:\n  slow: {{targets: [\"http://{}\"]}}\nroutes:\n  - name: slow\n    match: {{path_prefix: /}}\n    upstream: slow\n    key: header:x-key\n    limits:\n      - {{name: inflight, algorithm: concurrency, limit: 1}}\n      - {{name: hourly, algorithm: fixed_window, limit: 2, window: 1h}}\n",
        up.addr
    );
    let gw = start_gateway(&yaml).await;
    let (mut c1, h1) = open(gw.addr, "k").await;
    let t1 = up.next_tap().await;
    assert_eq!(header(&h1, "x-ratelimit-remaining"), Some("0"), "{h1}");
    // Refused by concurrency: the hourly count stays at 1.
    for _ in 0..3 {
        let (_c, h) = open(gw.addr, "k").await;
        assert_eq!(status(&h), "HTTP/1.1 429 Too Many Requests", "{h}");
        assert_eq!(header(&h, "ratelimit"), Some("\"inflight\";r=0;t=1"), "{h}");
    }
    finish(t1, &mut c1).await;
    assert_eq!(
        counted_eventually(gw.admin_addr, [1, 3, 4]).await,
        [1, 3, 4]
    );
    let (mut c2, h2) = open(gw.addr, "k").await;
    assert_eq!(status(&h2), "HTTP/1.1 200 OK", "{h2}");
    finish(up.next_tap().await, &mut c2).await;
    assert_eq!(
        counted_eventually(gw.admin_addr, [2, 3, 5]).await,
        [2, 3, 5]
    );
    // Refused by the hourly limit: no slot is taken, so none is left held.
    let (_c, h) = open(gw.addr, "k").await;
    assert_eq!(status(&h), "HTTP/1.1 429 Too Many Requests", "{h}");
    let id = gw.shared.runtime.load().routes[0]
        .limits
        .as_ref()
        .expect("limits")
        .default
        .plan
        .limits[0]
        .id;
    let store = gw.shared.store.memory_store().expect("memory store");
    assert_eq!(store.in_flight("slow", "k", id), 0);
}

// === Redis ===

/// Waits (200 times 10 ms at most) until Redis holds `left` leases of the key `k`;
/// else fail with `why`.
async fn leases_come_down_to(redis: &RedisServer, left: u64, why: &str) {
    for _ in 0..200 {
        let keys: Vec<String> = redis.cmd(&["KEYS", "sluice:{slow:k}:*"]);
        if redis.cmd::<u64>(&["ZCARD", keys[0].as_str()]) == left {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{why}");
}

fn redis_yaml(url: &str) -> String {
    redis_store(&url_target(url), "deny", 500)
}

#[tokio::test]
async fn redis_slots_are_held_until_the_body_ends() {
    let redis = RedisServer::start();
    let store = redis_yaml(&redis.url());
    let key = "sluice:{slow:k}:";
    let live = || {
        let keys: Vec<String> = redis.cmd(&["KEYS", &format!("{key}*")]);
        keys.first()
            .map_or(0, |k| redis.cmd::<u64>(&["ZCARD", k.as_str()]))
    };
    // The lease is removed off the request path: wait for it before the next request.
    let release = async || {
        for _ in 0..200 {
            if live() <= 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(live(), 1);
    };
    slots_are_held_until_the_body_ends(&store, release).await;
}

#[tokio::test]
async fn redis_a_client_that_goes_away_releases_its_slot() {
    let redis = RedisServer::start();
    let store = redis_yaml(&redis.url());
    let release = async || {
        leases_come_down_to(
            &redis,
            1,
            "the lease of the client that went away is still there",
        )
        .await;
    };
    a_client_that_goes_away_releases_its_slot(&store, release).await;
}

#[tokio::test]
async fn redis_cluster_runs_the_concurrency_script() {
    let cluster = RedisCluster::start();
    let store = redis_store(&cluster_target(&cluster.urls()), "deny", 500);
    let mut up = slow_upstream().await;
    let gw = start_gateway(&config(&up, &store)).await;
    let (mut c1, t1, _others) = two_pass_and_a_third_is_limited(gw.addr, &mut up).await;
    finish(t1, &mut c1).await;
    let passed = passes_within(gw.addr, 200, Duration::from_millis(10))
        .await
        .is_some();
    assert!(passed, "the released slot was never free again");
}

/// An instance that dies holding a slot: its lease (2 s) expires and the slot is
/// free again for the other instances.
#[tokio::test]
async fn a_lease_of_a_dead_instance_expires() {
    let redis = RedisServer::start();
    let store = redis_yaml(&redis.url());
    let mut up = slow_upstream().await;
    let yaml = one_slot_config(&up, &store, "2s");
    let mut holder = SluiceProcess::start(&[], &[], &yaml).await;
    let other = start_gateway(&yaml).await;
    let (_held, h) = open(holder.addr, "k").await;
    assert_eq!(status(&h), "HTTP/1.1 200 OK", "{h}");
    let _tap = up.next_tap().await;
    let (_c, h) = open(other.addr, "k").await;
    assert_eq!(status(&h), "HTTP/1.1 429 Too Many Requests", "{h}");

    // Killed while holding the slot: it never gives the lease back.
    unsafe {
        libc::killpg(holder.child.id() as i32, libc::SIGKILL);
    }
    let _ = holder.child.wait();
    let passed = passes_within(other.addr, 400, Duration::from_millis(20)).await;
    assert!(passed.is_some(), "the dead instance's lease never expired");
}

/// A response that streams for several leases keeps its slot: a live instance renews
/// its leases (a third of `lease` apart), so only a dead one's expire; when the
/// response ends, the slot is free.
#[tokio::test]
async fn redis_a_response_longer_than_its_lease_keeps_its_slot() {
    let redis = RedisServer::start();
    let store = redis_yaml(&redis.url());
    let mut up = slow_upstream().await;
    let yaml = one_slot_config(&up, &store, "300ms");
    let gw = start_gateway(&yaml).await;
    let (mut first, h) = open(gw.addr, "k").await;
    assert_eq!(status(&h), "HTTP/1.1 200 OK", "{h}");
    let tap = up.next_tap().await;
    // Three leases' time, the body still streaming.
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        tap.send(Bytes::from("more\n")).await.expect("body open");
    }
    let (_c, h) = open(gw.addr, "k").await;
    assert_eq!(status(&h), "HTTP/1.1 429 Too Many Requests", "{h}");
    finish(tap, &mut first).await;
    let passed = passes_within(gw.addr, 200, Duration::from_millis(10))
        .await
        .is_some();
    assert!(
        passed,
        "the slot was not given back when the response ended"
    );
}

/// A reload that raises the limit keeps the requests in flight: one more passes, not
/// `limit` more; a slot taken before the reload is given back after it.
async fn a_reload_keeps_the_requests_in_flight(store: &str, release: impl AsyncFn(u64)) {
    let mut up = slow_upstream().await;
    let base = config(&up, store);
    let with_limit =
        |limit: u64| base.replace("limit: 2, lease: 2s", &format!("limit: {limit}, lease: 3s"));
    let (gw, file) = start_gateway_file(&with_limit(1)).await;
    let (mut c1, h1) = open(gw.addr, "k").await;
    let t1 = up.next_tap().await;
    assert_eq!(status(&h1), "HTTP/1.1 200 OK", "{h1}");
    std::fs::write(file.path(), with_listeners(&with_limit(2))).expect("write config");
    gw.reload().await.expect("reload");
    let (mut c2, h2) = open(gw.addr, "k").await;
    let t2 = up.next_tap().await;
    assert_eq!(status(&h2), "HTTP/1.1 200 OK", "{h2}");
    assert_eq!(header(&h2, "x-ratelimit-remaining"), Some("0"), "{h2}");
    let (_c3, h3) = open(gw.addr, "k").await;
    assert_eq!(status(&h3), "HTTP/1.1 429 Too Many Requests", "{h3}");
    finish(t1, &mut c1).await;
    release(1).await;
    let (mut c4, h4) = open(gw.addr, "k").await;
    assert_eq!(status(&h4), "HTTP/1.1 200 OK", "{h4}");
    finish(up.next_tap().await, &mut c4).await;
    finish(t2, &mut c2).await;
}

#[tokio::test]
async fn memory_a_reload_keeps_the_requests_in_flight() {
    let up = async |_: u64| {};
    a_reload_keeps_the_requests_in_flight("", up).await;
}

#[tokio::test]
async fn redis_a_reload_keeps_the_requests_in_flight() {
    let redis = RedisServer::start();
    let store = redis_yaml(&redis.url());
    let release = async |left: u64| {
        leases_come_down_to(&redis, left, "the lease was not removed").await;
    };
    a_reload_keeps_the_requests_in_flight(&store, release).await;
}

/// Redis unreachable with `on_error: local`: this instance's memory holds the slots.
#[tokio::test]
async fn redis_down_the_local_fallback_holds_the_slots() {
    let mut redis = RedisServer::start();
    let store = redis_store(&url_target(&redis.url()), "local", 100);
    let mut up = slow_upstream().await;
    let gw = start_gateway(&config(&up, &store)).await;
    redis.kill();
    let (mut c1, t1, _others) = two_pass_and_a_third_is_limited(gw.addr, &mut up).await;
    finish(t1, &mut c1).await;
    let (mut c4, h4) = open(gw.addr, "k").await;
    assert_eq!(status(&h4), "HTTP/1.1 200 OK", "{h4}");
    finish(up.next_tap().await, &mut c4).await;
    let text = metrics(gw.admin_addr).await;
    assert_eq!(requests(&text, "slow", "store_error_allowed"), 2.0);
    assert_eq!(requests(&text, "slow", "limited"), 1.0);
}

/// A WebSocket holds its slot for as long as its tunnel is open.
#[tokio::test]
async fn a_websocket_holds_its_slot_until_the_tunnel_closes() {
    let up = upstream().await;
    let yaml = format!(
        "upstreams:\n  ws: {{targets: [\"{}\"]}}\nroutes:\n  - name: ws\n    match: {{path_prefix: /}}\n    upstream: ws\n    key: header:x-key\n    limits: [{{name: inflight, algorithm: concurrency, limit: 1}}]\n",
        up.url()
    );
    let gw = start_gateway(&yaml).await;
    let upgrade = b"GET /ws HTTP/1.1\r\nHost: a\r\nx-key: k\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n";
    let mut ws = connect(gw.addr).await;
    ws.write_all(upgrade).await.expect("write");
    let head = read_head(&mut ws).await.expect("101");
    assert_eq!(status(&head), "HTTP/1.1 101 Switching Protocols", "{head}");
    // The tunnel echoes.
    ws.write_all(b"ping").await.expect("write");
    let mut buf = [0u8; 4];
    bounded(
        "echo",
        tokio::io::AsyncReadExt::read_exact(&mut ws, &mut buf),
    )
    .await
    .expect("echo");
    assert_eq!(&buf, b"ping");

    let mut second = connect(gw.addr).await;
    second.write_all(upgrade).await.expect("write");
    let head = read_head(&mut second).await.expect("answer");
    assert_eq!(status(&head), "HTTP/1.1 429 Too Many Requests", "{head}");
    let text = metrics(gw.admin_addr).await;
    assert_eq!(requests(&text, "ws", "allowed"), 0.0);

    drop(ws);
    let mut passed = None;
    for _ in 0..200 {
        let text = metrics(gw.admin_addr).await;
        if requests(&text, "ws", "allowed") == 1.0 {
            let mut third = connect(gw.addr).await;
            third.write_all(upgrade).await.expect("write");
            passed = read_head(&mut third).await;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let head = passed.expect("the tunnel's end was counted");
    assert_eq!(status(&head), "HTTP/1.1 101 Switching Protocols", "{head}");
}
