//! The workload a profile-guided build of sluice learns from (`scripts/build-pgo`).
//!
//!     pgo_train <sluice binary> [--seconds S]
//!
//! Starts an upstream of its own, then the given `sluice` on the memory store, then
//! (when `redis-server` is installed) on a Redis of its own, and sends each a mix
//! of what a gateway meets: keep-alive requests with one hot key and with 10,000
//! keys, the five algorithms, refusals (429), deny-listed keys (403), request
//! bodies (with a length, and chunked), one request per connection, h2c, answers
//! sluice writes itself, larger upstream answers, and the admin endpoints. Each
//! phase runs S seconds (default 2), the proxied keep-alive ones twice that: the
//! profile weighs the common path most. The child gets `LLVM_PROFILE_FILE` from
//! `SLUICE_PGO_PROFILE` when that is set, and is stopped with SIGTERM so an
//! instrumented build writes its profile.
//!
//! Every answer is checked: a phase that gets a status it should not, no answer
//! at all, or a keep-alive connection that ends early (counted as status 0) fails
//! the run (exit 1), and so does a phase still running 20 s after its time. One
//! line per phase and store on stdout: `<store> <phase>: <status>=<count> ...`.
#![allow(clippy::print_stdout)]

#[path = "../tests/common/base.rs"]
mod base;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use base::{free_port, spawn_grouped, Spawned, BOUND};

type Counts = BTreeMap<u16, u64>;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let Some(bin) = args.get(1).cloned() else {
        eprintln!("usage: pgo_train <sluice binary> [--seconds S]");
        return ExitCode::from(2);
    };
    let seconds = match args.iter().position(|a| a == "--seconds") {
        Some(i) => match args.get(i + 1).and_then(|s| s.parse::<f64>().ok()) {
            Some(s) if s > 0.0 => s,
            _ => {
                eprintln!("pgo_train: --seconds takes a positive number");
                return ExitCode::from(2);
            }
        },
        None => 2.0,
    };
    let phase = Duration::from_secs_f64(seconds);
    let upstream = upstream().await;

    let mut failed = !train(&bin, "memory", "store: {backend: memory}", upstream, phase).await;
    match redis() {
        Some((_redis, port)) => {
            let store =
                format!("store: {{backend: redis, redis: {{url: redis://127.0.0.1:{port}}}}}");
            failed |= !train(&bin, "redis", &store, upstream, phase).await;
        }
        None => eprintln!("redis: skipped (no redis-server on PATH)"),
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// One sluice process on `store`, every phase against it, then SIGTERM. False when
/// anything was not as expected.
async fn train(bin: &str, name: &str, store: &str, upstream: SocketAddr, phase: Duration) -> bool {
    let (port, admin) = (free_port(), free_port());
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("rules.yaml");
    std::fs::write(&config, rules(port, admin, store, upstream)).expect("write config");
    let mut cmd = Command::new(bin);
    cmd.arg("run")
        .arg("-c")
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if let Some(file) = std::env::var_os("SLUICE_PGO_PROFILE") {
        cmd.env("LLVM_PROFILE_FILE", file);
    }
    let mut child = spawn_grouped(&mut cmd).expect("start sluice");
    let gw: SocketAddr = ([127, 0, 0, 1], port).into();
    let adm: SocketAddr = ([127, 0, 0, 1], admin).into();
    if !up(adm).await {
        eprintln!("{name}: sluice did not come up");
        return false;
    }

    let mut ok = true;
    let mut check = |phase: &str, counts: Counts, expect: &dyn Fn(&Counts) -> bool| {
        let line: Vec<String> = counts.iter().map(|(s, n)| format!("{s}={n}")).collect();
        println!("{name} {phase}: {}", line.join(" "));
        if counts.is_empty() || !expect(&counts) {
            eprintln!("{name} {phase}: not the statuses expected");
            ok = false;
        }
    };
    let only = |status: u16| move |c: &Counts| c.keys().all(|s| *s == status);

    let get = |path: &'static str, key: fn(u64) -> String| {
        move |i: u64| {
            format!(
                "GET {path} HTTP/1.1\r\nhost: t\r\nx-key: {}\r\n\r\n",
                key(i)
            )
            .into_bytes()
        }
    };
    check(
        "hot",
        h1(gw, 32, phase * 2, get("/api/items", |_| "hot".into())).await,
        &only(200),
    );
    check(
        "rotating",
        h1(
            gw,
            32,
            phase * 2,
            get("/api/items", |i| format!("key-{}", i % 10_000)),
        )
        .await,
        &only(200),
    );
    let algorithms = |i: u64| {
        let path = ["/fw", "/sw", "/tb", "/sl", "/gcra"][(i % 5) as usize];
        format!(
            "GET {path}/x?id={i} HTTP/1.1\r\nhost: t\r\nx-key: k{}\r\n\r\n",
            i % 1000
        )
        .into_bytes()
    };
    check(
        "algorithms",
        h1(gw, 16, phase, algorithms).await,
        &only(200),
    );
    // One key, a bucket of five refilled once an hour: exactly five pass, however
    // many connections race.
    check(
        "refused",
        h1(gw, 8, phase, get("/tight", |_| "one".into())).await,
        &|c| c.get(&200) == Some(&5) && c.get(&429).is_some_and(|n| *n > 0) && c.len() == 2,
    );
    check(
        "denied",
        h1(gw, 8, phase, get("/api/items", |_| "blocked".into())).await,
        &only(403),
    );
    let posts = |i: u64| {
        let body = "x".repeat(64 + (i % 7) as usize * 300);
        if i.is_multiple_of(2) {
            format!("POST /api/upload HTTP/1.1\r\nhost: t\r\nx-key: k{i}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len())
        } else {
            format!("POST /api/upload HTTP/1.1\r\nhost: t\r\nx-key: k{i}\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n", body.len())
        }
        .into_bytes()
    };
    check("bodies", h1(gw, 8, phase, posts).await, &only(200));
    check(
        "large",
        h1(gw, 8, phase, get("/api/large", |i| format!("k{}", i % 100))).await,
        &only(200),
    );
    check(
        "respond",
        h1(gw, 8, phase, get("/hello", |i| format!("k{i}"))).await,
        &only(200),
    );
    check("close", closing(gw, phase).await, &only(200));
    check("h2c", h2c(gw, phase).await, &only(200));
    let admin_get = |i: u64| {
        let path = ["/metrics", "/healthz", "/readyz"][(i % 3) as usize];
        format!("GET {path} HTTP/1.1\r\nhost: t\r\n\r\n").into_bytes()
    };
    check("admin", h1(adm, 1, phase / 4, admin_get).await, &only(200));

    // SIGTERM: an orderly exit, which is when an instrumented build writes its profile.
    child.signal(libc::SIGTERM);
    let exited = wait_exit(&mut child, Duration::from_secs(20)).await;
    if exited != Some(true) {
        eprintln!("{name}: sluice did not exit 0 on SIGTERM ({exited:?})");
        ok = false;
    }
    ok
}

fn rules(port: u16, admin: u16, store: &str, upstream: SocketAddr) -> String {
    let limit = |path: &str, algo: &str| {
        let spec = match algo {
            "fixed_window" | "sliding_window" | "sliding_log" => "limit: 1000000, window: 10s",
            _ => "rate: 1000000/s, burst: 1000000",
        };
        format!(
            "  - name: {algo}\n    match: {{path_prefix: {path}/}}\n    upstream: api\n    key: header:x-key\n    limits: [{{name: l, algorithm: {algo}, {spec}}}]\n"
        )
    };
    let mut routes = String::new();
    for (path, algo) in [
        ("/fw", "fixed_window"),
        ("/sw", "sliding_window"),
        ("/tb", "token_bucket"),
        ("/sl", "sliding_log"),
        ("/gcra", "gcra"),
    ] {
        routes.push_str(&limit(path, algo));
    }
    format!(
        "server: {{listen: \"127.0.0.1:{port}\", shutdown_grace: 1s}}
admin: {{listen: \"127.0.0.1:{admin}\"}}
{store}
response_headers: [ietf, x-ratelimit]
upstreams:
  api: {{targets: [\"http://{upstream}\"]}}
deny:
  keys: [blocked]
routes:
  - name: hello
    match: {{path: /hello}}
    key: header:x-key
    limits: [{{name: l, algorithm: fixed_window, limit: 1000000, window: 10s}}]
    respond: {{status: 200, body: \"hello\\n\"}}
  - name: tight
    match: {{path: /tight}}
    upstream: api
    key: header:x-key
    limits: [{{name: five, algorithm: token_bucket, rate: 1/h, burst: 5}}]
  - name: api
    match: {{path_prefix: /api/}}
    upstream: api
    key: header:x-key
    missing_key: ip
    limits:
      - {{name: burst, algorithm: gcra, rate: 1000000/s, burst: 1000000}}
      - {{name: daily, algorithm: fixed_window, limit: 100000000, window: 1d}}
{routes}"
    )
}

/// `conns` keep-alive connections sending `request(i)` one after another for
/// `time`; the statuses that came back. A connection that fails, or that sluice
/// closes, counts as status 0: these phases train keep-alive.
async fn h1<F>(addr: SocketAddr, conns: u64, time: Duration, request: F) -> Counts
where
    F: Fn(u64) -> Vec<u8> + Send + Sync + 'static,
{
    let request = Arc::new(request);
    let end = Instant::now() + time;
    let tasks: Vec<_> = (0..conns)
        .map(|c| {
            let request = request.clone();
            tokio::spawn(async move {
                let mut counts = Counts::new();
                let Ok(mut s) = TcpStream::connect(addr).await else {
                    counts.insert(0, 1);
                    return counts;
                };
                let _ = s.set_nodelay(true);
                let mut buf = Vec::new();
                let mut i = c;
                while Instant::now() < end {
                    let got = match s.write_all(&request(i)).await {
                        Ok(()) => answer(&mut s, &mut buf).await,
                        Err(_) => None,
                    };
                    match got {
                        Some((status, false)) => *counts.entry(status).or_default() += 1,
                        Some((status, true)) => {
                            *counts.entry(status).or_default() += 1;
                            *counts.entry(0).or_default() += 1;
                            break;
                        }
                        None => {
                            *counts.entry(0).or_default() += 1;
                            break;
                        }
                    }
                    i += conns;
                }
                counts
            })
        })
        .collect();
    sum(time, tasks).await
}

/// The statuses the tasks counted, added up; a task that panicked, or that is not
/// done `BOUND` after the phase's `time`, counts as status 0.
async fn sum(time: Duration, tasks: Vec<tokio::task::JoinHandle<Counts>>) -> Counts {
    let deadline = tokio::time::Instant::now() + time + BOUND;
    let mut all = Counts::new();
    for t in tasks {
        match tokio::time::timeout_at(deadline, t).await {
            Ok(Ok(counts)) => {
                for (s, n) in counts {
                    *all.entry(s).or_default() += n;
                }
            }
            _ => *all.entry(0).or_default() += 1,
        }
    }
    all
}

/// One request per connection (`Connection: close`), four at a time, for `time`.
async fn closing(addr: SocketAddr, time: Duration) -> Counts {
    let end = Instant::now() + time;
    let tasks: Vec<_> = (0..4)
        .map(|c| {
            tokio::spawn(async move {
                let mut counts = Counts::new();
                let mut buf = Vec::new();
                let mut i = c;
                while Instant::now() < end {
                    buf.clear();
                    let req = format!(
                        "GET /api/items HTTP/1.1\r\nhost: t\r\nconnection: close\r\nx-key: c{}\r\n\r\n",
                        i % 100
                    );
                    let got = match TcpStream::connect(addr).await {
                        Ok(mut s) => match s.write_all(req.as_bytes()).await {
                            Ok(()) => answer(&mut s, &mut buf).await,
                            Err(_) => None,
                        },
                        Err(_) => None,
                    };
                    *counts.entry(got.map_or(0, |(status, _)| status)).or_default() += 1;
                    if got.is_none() {
                        break;
                    }
                    i += 4;
                }
                counts
            })
        })
        .collect();
    sum(time, tasks).await
}

/// Reads one HTTP/1.1 answer (to a request that was not HEAD) from `s`, with what
/// `buf` already holds: its status, and whether the server closes after it.
async fn answer(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<(u16, bool)> {
    let (status, close, head, length, chunked) = loop {
        let mut fields = [httparse::EMPTY_HEADER; 32];
        let mut r = httparse::Response::new(&mut fields);
        if let httparse::Status::Complete(n) = r.parse(buf).ok()? {
            let has = |name: &str, value: &str| {
                r.headers.iter().any(|h| {
                    h.name.eq_ignore_ascii_case(name)
                        && String::from_utf8_lossy(h.value)
                            .to_ascii_lowercase()
                            .contains(value)
                })
            };
            let length = r
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                .and_then(|h| {
                    std::str::from_utf8(h.value)
                        .ok()?
                        .trim()
                        .parse::<usize>()
                        .ok()
                });
            break (
                r.code?,
                has("connection", "close"),
                n,
                length,
                has("transfer-encoding", "chunked"),
            );
        }
        if !fill(s, buf).await {
            return None;
        }
    };
    buf.drain(..head);
    if chunked {
        // Chunks: size line, data, CRLF; the last is size 0 (no trailers here).
        loop {
            let line = loop {
                if let Some(at) = buf.windows(2).position(|w| w == b"\r\n") {
                    break at;
                }
                if !fill(s, buf).await {
                    return None;
                }
            };
            let size =
                usize::from_str_radix(std::str::from_utf8(&buf[..line]).ok()?.trim(), 16).ok()?;
            while buf.len() < line + 2 + size + 2 {
                if !fill(s, buf).await {
                    return None;
                }
            }
            buf.drain(..line + 2 + size + 2);
            if size == 0 {
                break;
            }
        }
    } else {
        let length = length.unwrap_or(0);
        while buf.len() < length {
            if !fill(s, buf).await {
                return None;
            }
        }
        buf.drain(..length);
    }
    Some((status, close))
}

async fn fill(s: &mut TcpStream, buf: &mut Vec<u8>) -> bool {
    let mut chunk = [0u8; 16 * 1024];
    match s.read(&mut chunk).await {
        Ok(0) | Err(_) => false,
        Ok(n) => {
            buf.extend_from_slice(&chunk[..n]);
            true
        }
    }
}

/// h2c (prior knowledge): two connections, eight streams each at a time, for
/// `time`. A connection or stream that fails counts as status 0.
async fn h2c(addr: SocketAddr, time: Duration) -> Counts {
    let end = Instant::now() + time;
    let mut tasks = Vec::new();
    for c in 0..2u64 {
        let handshake = async {
            let stream = TcpStream::connect(addr).await.ok()?;
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                .await
                .ok()
        };
        let Ok(Some((sender, conn))) = tokio::time::timeout(BOUND, handshake).await else {
            tasks.push(tokio::spawn(async { Counts::from([(0, 1)]) }));
            continue;
        };
        tokio::spawn(conn);
        for s in 0..8u64 {
            let mut sender = sender.clone();
            tasks.push(tokio::spawn(async move {
                let mut counts = Counts::new();
                let mut i = c * 8 + s;
                while Instant::now() < end {
                    let req = http::Request::get(format!("http://{addr}/api/items"))
                        .header("x-key", format!("h{}", i % 1000))
                        .body(Empty::<Bytes>::new())
                        .expect("request");
                    let got = async {
                        let resp = sender.send_request(req).await.ok()?;
                        let status = resp.status().as_u16();
                        resp.into_body().collect().await.ok().map(|_| status)
                    };
                    let Some(status) = got.await else {
                        *counts.entry(0).or_default() += 1;
                        break;
                    };
                    *counts.entry(status).or_default() += 1;
                    i += 16;
                }
                counts
            }));
        }
    }
    sum(time, tasks).await
}

/// The upstream: hyper, HTTP/1.1, answering `ok` (or 32 KiB under /api/large)
/// after reading the whole request body.
async fn upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind upstream");
    let addr = listener.local_addr().expect("upstream address");
    let large = Bytes::from(vec![b'x'; 32 * 1024]);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            let large = large.clone();
            tokio::spawn(async move {
                let service =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let large = large.clone();
                        async move {
                            let is_large = req.uri().path().starts_with("/api/large");
                            let _ = req.into_body().collect().await;
                            let body = if is_large {
                                large
                            } else {
                                Bytes::from_static(b"ok\n")
                            };
                            let resp = http::Response::builder()
                                .header("content-type", "text/plain")
                                .header("cache-control", "no-store")
                                .body(Full::new(body))
                                .expect("response");
                            Ok::<_, Infallible>(resp)
                        }
                    });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

/// A redis-server of our own on a free port; None when none is installed.
fn redis() -> Option<(Spawned, u16)> {
    let port = free_port();
    let mut cmd = Command::new("redis-server");
    cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(std::env::temp_dir())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let child = spawn_grouped(&mut cmd).ok()?;
    let end = Instant::now() + Duration::from_secs(10);
    while Instant::now() < end {
        if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            use std::io::{Read, Write};
            let mut pong = [0u8; 7];
            if s.write_all(b"PING\r\n").is_ok()
                && s.read_exact(&mut pong).is_ok()
                && &pong == b"+PONG\r\n"
            {
                return Some((child, port));
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("redis-server on {port} does not answer PING");
}

/// Waits until the admin listener answers `/healthz` with 200 (at most 20 s).
async fn up(admin: SocketAddr) -> bool {
    let end = Instant::now() + Duration::from_secs(20);
    while Instant::now() < end {
        if let Ok(mut s) = TcpStream::connect(admin).await {
            let mut buf = Vec::new();
            if s.write_all(b"GET /healthz HTTP/1.1\r\nhost: t\r\n\r\n")
                .await
                .is_ok()
                && answer(&mut s, &mut buf).await.map(|a| a.0) == Some(200)
            {
                return true;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// The child's exit: Some(true) for status 0, None if it still runs after `within`.
async fn wait_exit(child: &mut Spawned, within: Duration) -> Option<bool> {
    let end = Instant::now() + within;
    while Instant::now() < end {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status.success());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}
