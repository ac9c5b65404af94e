//! gRPC through sluice with a real gRPC stack at both ends (Python's grpcio:
//! tests/fixtures/grpc/server.py and client.py): every kind of call over h2c and
//! over TLS (h2), messages of several MiB, the upstream's statuses unchanged,
//! deadlines and cancellation reaching the upstream, and every answer sluice gives
//! itself read by a real client as its gRPC code.

use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::future::join_all;
use http::Method;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::common::*;

/// Debian's Python, which has python3-grpcio (the `python3` first on PATH may be
/// another one).
const PYTHON: &str = "/usr/bin/python3";

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/grpc")
        .join(name)
}

/// Fails the test, never skips it, when the Python has no grpc module.
fn need_grpcio() {
    static CHECKED: OnceLock<Result<(), String>> = OnceLock::new();
    let checked = CHECKED.get_or_init(|| {
        match run_grouped(Command::new(PYTHON).args(["-c", "import grpc"])) {
            Ok(out) if out.status.success() => Ok(()),
            Ok(out) => Err(String::from_utf8_lossy(&out.stderr).trim().to_string()),
            Err(e) => Err(e.to_string()),
        }
    });
    if let Err(e) = checked {
        panic!(
            "{PYTHON} cannot import grpc ({e}): run tests/run.sh, which installs python3-grpcio"
        );
    }
}

// === the gRPC server ===

/// server.py, listening on 127.0.0.1; what it saw, from the JSON lines it writes.
struct GrpcServer {
    _process: Spawned,
    lines: Lines,
    port: u16,
}

impl GrpcServer {
    async fn start() -> GrpcServer {
        GrpcServer::spawn(&[]).await
    }

    /// Over TLS with this certificate.
    async fn start_tls(certs: &SelfSigned) -> GrpcServer {
        GrpcServer::spawn(&[
            "--tls".as_ref(),
            certs.cert_pem.path().as_os_str(),
            certs.key_pem.path().as_os_str(),
        ])
        .await
    }

    async fn spawn(args: &[&std::ffi::OsStr]) -> GrpcServer {
        need_grpcio();
        let mut cmd = Command::new(PYTHON);
        cmd.arg(fixture("server.py"))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        let (mut process, lines, _reader) = spawn_logged(&mut cmd);
        let t0 = Instant::now();
        let port = loop {
            let ready = parse(&lines)
                .into_iter()
                .find(|e| e["event"] == "ready")
                .and_then(|e| e["port"].as_u64());
            if let Some(port) = ready {
                break u16::try_from(port).expect("a port");
            }
            if let Ok(Some(status)) = process.try_wait() {
                panic!("server.py ended ({status}): {:?}", lines.lock().unwrap());
            }
            assert!(t0.elapsed() < BOUND, "server.py not ready within {BOUND:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        GrpcServer {
            _process: process,
            lines,
            port,
        }
    }

    /// `127.0.0.1:PORT`, as gRPC clients name a target.
    fn target(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The events `event` ("call", "end") of `method`, in order.
    fn events(&self, event: &str, method: &str) -> Vec<Value> {
        parse(&self.lines)
            .into_iter()
            .filter(|e| e["event"] == event && e["method"] == method)
            .collect()
    }

    /// The one "end" event of `method`, once it came (within 2 s).
    async fn ended(&self, method: &str) -> Value {
        let came = eventually(Duration::from_secs(2), || {
            let n = self.events("end", method).len();
            async move { n > 0 }
        })
        .await;
        assert!(
            came.is_some(),
            "no end of {method} within 2 s: {:?}",
            self.lines.lock().unwrap()
        );
        let mut ends = self.events("end", method);
        assert_eq!(ends.len(), 1, "{ends:?}");
        ends.remove(0)
    }
}

/// The JSON lines among `lines` (grpcio may log other lines there).
fn parse(lines: &Lines) -> Vec<Value> {
    let lines = lines.lock().unwrap();
    lines
        .iter()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

// === the gRPC client ===

/// One call as client.py saw it.
#[derive(Debug, Deserialize, PartialEq)]
struct Call {
    code: String,
    details: String,
    initial: Vec<(String, String)>,
    trailing: Vec<(String, String)>,
    replies: Vec<Value>,
    received: u64,
    ms: u64,
}

impl Call {
    /// The call without its duration, to compare a direct call with one through
    /// sluice.
    fn untimed(self) -> Call {
        Call { ms: 0, ..self }
    }
}

/// Runs client.py with `spec` (see its docstring) against `target`: its calls.
async fn calls(target: &str, spec: &Value) -> Vec<Call> {
    need_grpcio();
    let mut cmd = Command::new(PYTHON);
    cmd.arg(fixture("client.py"))
        .arg(target)
        .arg(spec.to_string());
    let run = tokio::task::spawn_blocking(move || run_grouped(&mut cmd));
    let out = bounded("client.py", run)
        .await
        .expect("client task")
        .expect("client.py runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "client.py {spec}: {}\n{stderr}",
        out.status
    );
    #[derive(Deserialize)]
    struct Out {
        calls: Vec<Call>,
    }
    let parsed: Out = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "client.py {spec}: {e}: {}\n{stderr}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    parsed
        .calls
        .into_iter()
        .map(|mut c| {
            // sluice's server (hyper's) dates every answer, as RFC 9110 (6.6.1)
            // allows a proxy to; a gRPC client sees it as metadata. The rest of the
            // metadata must be as the upstream sent it.
            for md in [&mut c.initial, &mut c.trailing] {
                md.retain(|(k, _)| k != "date");
            }
            c
        })
        .collect()
}

/// The same call directly to `server` and through sluice at `via`, at once.
async fn both(server: &GrpcServer, via: &str, spec: &Value) -> (Call, Call) {
    let direct = server.target();
    tokio::join!(call(&direct, spec), call(via, spec))
}

async fn call(target: &str, spec: &Value) -> Call {
    let mut all = calls(target, spec).await;
    assert_eq!(all.len(), 1, "{all:?}");
    all.remove(0)
}

/// Metadata as client.py reports it, from (name, value) pairs.
fn md(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Metadata sorted by name: the order of different names means nothing.
fn sorted(md: &[(String, String)]) -> Vec<(String, String)> {
    let mut md = md.to_vec();
    md.sort();
    md
}

// === raw gRPC over h2c (hyper), where the wire matters ===

/// One gRPC message, length-prefixed and uncompressed.
fn grpc_frame(message: &[u8]) -> Bytes {
    let mut framed = vec![0];
    framed.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    framed.extend_from_slice(message);
    framed.into()
}

/// A unary gRPC call to `addr` over h2c, read whole.
async fn raw_call(addr: &str, path: &str, headers: Headers<'_>, message: &[u8]) -> Resp {
    let mut all = vec![("content-type", "application/grpc"), ("te", "trailers")];
    all.extend_from_slice(headers);
    h2c()
        .send(
            Method::POST,
            &format!("http://{addr}{path}"),
            &all,
            grpc_frame(message),
        )
        .await
}

/// The header names of an answer, sorted.
fn names(r: &Resp) -> Vec<&str> {
    let mut names: Vec<&str> = r.headers.keys().map(|k| k.as_str()).collect();
    names.sort_unstable();
    names
}

// === configuration ===

/// Upstream `greeter` (h2c to `target`, with `extra` fields) and `routes`.
fn config(target: &str, extra: &str, routes: &str) -> String {
    format!(
        "upstreams:\n  greeter: {{targets: [\"http://{target}\"], protocol: h2c, probe: false{extra}}}\n\
         routes:\n{routes}"
    )
}

/// Every method of the service, to greeter, no limit.
const ECHO: &str = "  - {name: echo, match: {path_prefix: /test.Echo/}, upstream: greeter}\n";

// === passthrough ===

/// Unary, server-streaming, client-streaming and bidirectional calls: through
/// sluice, the client sees exactly what it sees directly; the bidirectional call
/// is a ping-pong (each message sent only after the reply to the one before came
/// back), so neither direction waits for the other's end. The upstream sees the
/// client's metadata and X-Forwarded-For. 100 calls at once on one connection
/// each get their own answer.
#[tokio::test]
async fn every_kind_of_call_passes_through_as_it_does_directly() {
    let server = GrpcServer::start().await;
    let gw = start_gateway(&config(&server.target(), "", ECHO)).await;
    let via = gw.addr.to_string();
    let cases = [
        (
            json!({"call": "unary", "method": "/test.Echo/Unary", "request": "hello",
                   "metadata": [["x-api-key", "k1"]]}),
            json!(["hello"]),
        ),
        (
            json!({"call": "server_stream", "method": "/test.Echo/ServerStream", "request": "3"}),
            json!(["reply-0", "reply-1", "reply-2"]),
        ),
        (
            json!({"call": "bidi", "method": "/test.Echo/Bidi", "timeout": 10,
                   "messages": ["ping-0", "ping-1", "ping-2", "ping-3"]}),
            json!(["ping-0", "ping-1", "ping-2", "ping-3"]),
        ),
    ];
    for (spec, replies) in &cases {
        let (direct, through) = both(&server, &via, spec).await;
        assert_eq!(through.code, "OK", "{spec}: {through:?}");
        assert_eq!(&json!(through.replies), replies, "{spec}");
        assert_eq!((&through.initial, &through.trailing), (&vec![], &vec![]));
        assert_eq!(through.untimed(), direct.untimed(), "{spec}");
    }
    // The client stream's reply: a summary of what the server took, the same both ways.
    let spec = json!({"call": "client_stream", "method": "/test.Echo/ClientStream",
                      "messages": ["one", "two", "three"]});
    let (direct, through) = both(&server, &via, &spec).await;
    assert_eq!(through.code, "OK", "{through:?}");
    let summary: Value = serde_json::from_str(through.replies[0].as_str().unwrap()).unwrap();
    assert_eq!(
        (&summary["count"], &summary["bytes"]),
        (&json!(3), &json!(11))
    );
    assert_eq!(through.untimed(), direct.untimed());

    let unary = server.events("call", "Unary");
    assert_eq!(unary.len(), 2, "{unary:?}");
    // The two calls ran at once: the one through sluice is the forwarded one.
    let (mut direct, mut through) = (&unary[0]["metadata"], &unary[1]["metadata"]);
    if direct["x-forwarded-for"] != Value::Null {
        std::mem::swap(&mut direct, &mut through);
    }
    assert_eq!(through["x-api-key"], "k1");
    assert_eq!(through["x-forwarded-for"], "127.0.0.1");
    assert_eq!(through["x-forwarded-proto"], "http");
    assert_eq!(direct["x-forwarded-for"], Value::Null);
    assert_eq!(through["user-agent"], direct["user-agent"]);

    // 100 calls at once on the client's one connection, each answered as its own.
    let spec = json!({"call": "unary", "method": "/test.Echo/Unary", "request": "call",
                      "parallel": 100, "timeout": 10});
    let all = calls(&via, &spec).await;
    let replies: Vec<_> = all
        .iter()
        .map(|c| (c.code.as_str(), json!(c.replies)))
        .collect();
    let wanted: Vec<_> = (0..100)
        .map(|i| ("OK", json!([format!("call-{i}")])))
        .collect();
    assert_eq!(replies, wanted);

    let m = metrics(gw.admin_addr).await;
    assert_eq!(decisions(&m, "echo"), [("allowed", 104.0)]);
}

/// Messages of 4 MiB and more, both ways: a 4 MiB echo, an 8 MiB client stream, a
/// 6 MiB reply and a ping-pong of two 4 MiB messages arrive whole and unchanged.
#[tokio::test]
async fn messages_of_several_mib_pass_both_ways() {
    const MIB: u64 = 1 << 20;
    let server = GrpcServer::start().await;
    let gw = start_gateway(&config(&server.target(), "", ECHO)).await;
    let via = gw.addr.to_string();
    let whole = |n: u64| json!({"len": n, "pattern": true});

    let echo = json!({"call": "unary", "method": "/test.Echo/Unary",
                      "request": {"pattern": 4 * MIB}});
    let c = call(&via, &echo).await;
    assert_eq!(
        (c.code.as_str(), json!(c.replies), c.received),
        ("OK", json!([whole(4 * MIB)]), 4 * MIB)
    );
    assert_eq!(server.events("call", "Unary")[0]["bytes"], 4 * MIB);

    let big = json!({"call": "unary", "method": "/test.Echo/Big", "request": "6"});
    let c = call(&via, &big).await;
    assert_eq!(
        (c.code.as_str(), json!(c.replies), c.received),
        ("OK", json!([whole(6 * MIB)]), 6 * MIB)
    );

    let pingpong = json!({"call": "bidi", "method": "/test.Echo/Bidi", "timeout": 10,
                          "messages": [{"pattern": 4 * MIB}, {"pattern": 4 * MIB + 1}]});
    let c = call(&via, &pingpong).await;
    assert_eq!(
        (c.code.as_str(), json!(c.replies), c.received),
        (
            "OK",
            json!([whole(4 * MIB), whole(4 * MIB + 1)]),
            8 * MIB + 1
        )
    );

    // The digest of what the server took, through sluice and directly.
    let upload = json!({"call": "client_stream", "method": "/test.Echo/ClientStream",
                        "messages": [{"pattern": 4 * MIB}, {"pattern": 4 * MIB}]});
    let (direct, through) = both(&server, &via, &upload).await;
    assert_eq!(through.code, "OK", "{through:?}");
    let summary: Value = serde_json::from_str(through.replies[0].as_str().unwrap()).unwrap();
    assert_eq!(
        (&summary["count"], &summary["bytes"]),
        (&json!(2), &json!(8 * MIB))
    );
    assert_eq!(through.untimed(), direct.untimed());

    let m = metrics(gw.admin_addr).await;
    assert_eq!(decisions(&m, "echo"), [("allowed", 4.0)]);
}

/// The upstream's own statuses reach the client unchanged: an error in
/// Trailers-Only (with a UTF-8 message, percent-encoded on the wire), an error
/// after headers and a message, its trailing metadata, and the upstream's own
/// UNIMPLEMENTED for a method it does not have. On the wire, a Trailers-Only
/// answer stays one: a head with `grpc-status`, no body, no trailers.
#[tokio::test]
async fn upstream_statuses_reach_the_client_unchanged() {
    let server = GrpcServer::start().await;
    let gw = start_gateway(&config(&server.target(), "", ECHO)).await;
    let via = gw.addr.to_string();
    let not_found = json!({"code": "NOT_FOUND", "message": "no such thing: ü 100%",
                           "mode": "trailers-only"})
    .to_string();
    let aborted =
        json!({"code": "ABORTED", "message": "later", "mode": "after-message"}).to_string();
    let kept = md(&[("x-fail-trailer", "kept")]);
    let cases = [
        (
            json!({"call": "server_stream", "method": "/test.Echo/Fail", "request": not_found}),
            (
                "NOT_FOUND",
                "no such thing: ü 100%",
                vec![],
                kept.clone(),
                json!([]),
            ),
        ),
        (
            json!({"call": "server_stream", "method": "/test.Echo/Fail", "request": aborted}),
            (
                "ABORTED",
                "later",
                md(&[("x-early", "yes")]),
                kept.clone(),
                json!(["partial"]),
            ),
        ),
        (
            json!({"call": "unary", "method": "/test.Echo/Missing", "request": ""}),
            (
                "UNIMPLEMENTED",
                "Method not found!",
                vec![],
                vec![],
                json!([]),
            ),
        ),
    ];
    for (spec, (code, details, initial, trailing, replies)) in cases {
        let (direct, through) = both(&server, &via, &spec).await;
        assert_eq!(
            (
                through.code.as_str(),
                through.details.as_str(),
                &through.initial,
                &through.trailing,
                json!(through.replies)
            ),
            (code, details, &initial, &trailing, replies),
            "{spec}"
        );
        assert_eq!(through.untimed(), direct.untimed(), "{spec}");
    }

    let direct = raw_call(
        &server.target(),
        "/test.Echo/Fail",
        &[],
        not_found.as_bytes(),
    )
    .await;
    let through = raw_call(&via, "/test.Echo/Fail", &[], not_found.as_bytes()).await;
    for r in [&direct, &through] {
        assert_eq!(r.status, 200);
        assert_eq!(r.header("grpc-status"), Some("5"));
        assert_eq!(
            r.header("grpc-message"),
            Some("no such thing: %C3%BC 100%25")
        );
        assert_eq!(r.header("x-fail-trailer"), Some("kept"));
        assert_eq!((r.body.len(), &r.trailers), (0, &None), "{r:?}");
    }
    // The same fields, and the Date sluice's server adds to every answer.
    let mut dated = names(&direct);
    dated.push("date");
    dated.sort_unstable();
    assert_eq!(names(&through), dated);

    let m = metrics(gw.admin_addr).await;
    assert_eq!(decisions(&m, "echo"), [("allowed", 4.0)]);
}

// === deadlines and cancellation ===

/// A client's deadline ends the call on both sides at once: the client's
/// `grpc-timeout` reaches the upstream, and when it passes during a stream the
/// upstream's call ends too.
#[tokio::test]
async fn a_client_deadline_ends_the_call_on_both_sides() {
    let server = GrpcServer::start().await;
    let gw = start_gateway(&config(&server.target(), "", ECHO)).await;
    let via = gw.addr.to_string();

    let spec = json!({"call": "server_stream", "method": "/test.Echo/Watch",
                      "request": "10000", "timeout": 0.5});
    let c = call(&via, &spec).await;
    assert_eq!(
        (c.code.as_str(), c.details.as_str(), json!(c.replies)),
        ("DEADLINE_EXCEEDED", "Deadline Exceeded", json!(["started"]))
    );
    assert!((500..1500).contains(&c.ms), "{c:?}");
    let watch = &server.events("call", "Watch")[0];
    let left = watch["deadline_ms"].as_u64().expect("a deadline upstream");
    assert!((300..=500).contains(&left), "{watch}");
    let end = server.ended("Watch").await;
    assert_eq!(end["cancelled"], true, "{end}");
    assert!(end["ms"].as_u64().unwrap() < 1500, "{end}");

    let m = metrics(gw.admin_addr).await;
    assert_eq!(decisions(&m, "echo"), [("allowed", 1.0)]);
}

/// A call whose answer has not come when its `grpc-timeout` passes gets
/// DEADLINE_EXCEEDED from sluice, although the upstream's `timeout` (30 s) is
/// longer; the upstream saw the same `grpc-timeout`, and its stream is cancelled.
/// The upstream is hyper's here: a gRPC server would answer DEADLINE_EXCEEDED
/// itself at the same moment, and the test could not tell whose answer came.
#[tokio::test]
async fn a_grpc_timeout_shorter_than_the_upstreams_is_sluices_deadline() {
    let up = silent_upstream().await;
    let gw = start_gateway(&config(&up.addr.to_string(), "", ECHO)).await;
    let t0 = Instant::now();
    let r = raw_call(
        &gw.addr.to_string(),
        "/test.Echo/Unary",
        &[("grpc-timeout", "300m")],
        b"hi",
    )
    .await;
    let took = t0.elapsed();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("grpc-status"), Some("4"));
    assert_eq!(
        r.header("grpc-message"),
        Some("upstream did not answer in time")
    );
    assert_eq!((r.body.len(), &r.trailers), (0, &None), "{r:?}");
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_millis(1300),
        "{took:?}"
    );
    assert_eq!(*up.timeouts.lock().unwrap(), [Some("300m".to_string())]);
    let cancelled = eventually(Duration::from_secs(2), || {
        let n = up.cancelled.load(Ordering::SeqCst);
        async move { n == 1 }
    })
    .await;
    assert!(
        cancelled.is_some(),
        "the upstream's stream was not cancelled"
    );

    let m = metrics(gw.admin_addr).await;
    assert_eq!(decisions(&m, "echo"), [("allowed", 1.0)]);
    assert_eq!(
        metric(
            &m,
            r#"sluice_upstream_errors_total{kind="timeout",route="echo"}"#
        ),
        Some(1.0)
    );
}

/// An h2c server (hyper's) that takes every request and never answers it.
struct Silent {
    addr: std::net::SocketAddr,
    /// Each request's `grpc-timeout`, in order.
    timeouts: Arc<Mutex<Vec<Option<String>>>>,
    /// Requests given up on by the client (their stream reset, or the connection
    /// closed): hyper drops a request's handler then.
    cancelled: Arc<AtomicUsize>,
}

async fn silent_upstream() -> Silent {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let timeouts: Arc<Mutex<Vec<Option<String>>>> = Arc::default();
    let cancelled = Arc::new(AtomicUsize::new(0));
    let (seen, dropped) = (timeouts.clone(), cancelled.clone());
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (seen, dropped) = (seen.clone(), dropped.clone());
            let service = service_fn(move |req: http::Request<Incoming>| {
                let timeout = req.headers().get("grpc-timeout");
                seen.lock()
                    .unwrap()
                    .push(timeout.map(|v| v.to_str().unwrap().to_string()));
                let on_drop = Counted(dropped.clone());
                async move {
                    let _on_drop = on_drop;
                    std::future::pending::<Result<http::Response<Full<Bytes>>, Infallible>>().await
                }
            });
            tokio::spawn(
                hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service),
            );
        }
    });
    Silent {
        addr,
        timeouts,
        cancelled,
    }
}

/// Counts its own drop.
struct Counted(Arc<AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// A client that cancels a call cancels the upstream's call: the server's stream,
/// which would run 10 s, ends as cancelled at once.
#[tokio::test]
async fn a_client_cancel_reaches_the_upstream() {
    let server = GrpcServer::start().await;
    let gw = start_gateway(&config(&server.target(), "", ECHO)).await;
    let spec = json!({"call": "cancel", "method": "/test.Echo/Watch", "request": "10000"});
    let c = call(&gw.addr.to_string(), &spec).await;
    assert_eq!(
        (c.code.as_str(), c.details.as_str(), json!(c.replies)),
        (
            "CANCELLED",
            "Locally cancelled by application!",
            json!(["started"])
        )
    );
    let end = server.ended("Watch").await;
    assert_eq!(end["cancelled"], true, "{end}");
    assert!(end["ms"].as_u64().unwrap() < 2000, "{end}");
    let m = metrics(gw.admin_addr).await;
    assert_eq!(decisions(&m, "echo"), [("allowed", 1.0)]);
}

// === sluice's own answers ===

/// A limited call: RESOURCE_EXHAUSTED with the limit's message (an unnamed limit
/// is `<algorithm>_<index>`), when to retry (`retry-after`,
/// `grpc-retry-pushback-ms`) and the rate-limit fields as trailing metadata; the
/// calls let through carry the rate-limit fields as initial metadata.
#[tokio::test]
async fn a_limited_call_is_resource_exhausted_with_when_to_retry() {
    let server = GrpcServer::start().await;
    let routes = "  - name: say\n    match: {path: /test.Echo/Unary}\n    upstream: greeter\n    \
                  key: header:x-api-key\n    \
                  limits: [{algorithm: fixed_window, limit: 3, window: 1s}]\n";
    let gw = start_gateway(&config(&server.target(), "", routes)).await;
    let spec = json!({"call": "unary", "method": "/test.Echo/Unary", "request": "hi",
                      "metadata": [["x-api-key", "k1"]], "repeat": 5, "align_ms": 1000});
    let all = calls(&gw.addr.to_string(), &spec).await;
    let policy = r#""fixed_window_0";q=3;w=1"#;
    for (left, c) in all[..3].iter().enumerate().map(|(i, c)| (2 - i, c)) {
        assert_eq!((c.code.as_str(), json!(c.replies)), ("OK", json!(["hi"])));
        let left = left.to_string();
        let ratelimit = format!(r#""fixed_window_0";r={left};t=1"#);
        assert_eq!(
            sorted(&c.initial),
            md(&[
                ("ratelimit", &ratelimit),
                ("ratelimit-policy", policy),
                ("x-ratelimit-limit", "3"),
                ("x-ratelimit-remaining", &left),
                ("x-ratelimit-reset", "1"),
            ]),
            "{c:?}"
        );
    }
    for c in &all[3..] {
        assert_eq!(
            (c.code.as_str(), c.details.as_str(), c.received),
            (
                "RESOURCE_EXHAUSTED",
                r#"rate limit "fixed_window_0" of route "say" exceeded; retry in 1s"#,
                0
            )
        );
        assert_eq!(
            sorted(&c.trailing),
            md(&[
                ("grpc-retry-pushback-ms", "1000"),
                ("ratelimit", r#""fixed_window_0";r=0;t=1"#),
                ("ratelimit-policy", policy),
                ("retry-after", "1"),
                ("x-ratelimit-limit", "3"),
                ("x-ratelimit-remaining", "0"),
                ("x-ratelimit-reset", "1"),
            ]),
            "{c:?}"
        );
    }
    assert_eq!(server.events("call", "Unary").len(), 3);
    let m = metrics(gw.admin_addr).await;
    assert_eq!(decisions(&m, "say"), [("allowed", 3.0), ("limited", 2.0)]);
}

/// Every other answer sluice gives itself, as a real client reads it: denied, by
/// key or by address (PERMISSION_DENIED, whatever HTTP status `deny` names), no key (UNAUTHENTICATED), no route (UNIMPLEMENTED), an
/// upstream that refuses connections (UNAVAILABLE), an upstream slower than its
/// `timeout` (DEADLINE_EXCEEDED, and the upstream's call is cancelled). On the
/// wire each is HTTP 200 with `grpc-status` in the head and no body, no trailers.
#[tokio::test]
async fn sluices_own_answers_are_read_as_grpc_codes() {
    let server = GrpcServer::start().await;
    let dead = free_port();
    let target = server.target();
    let yaml = format!(
        r#"
client_ip: {{trusted_proxies: [127.0.0.1/32]}}
deny: {{keys: [blocked], ips: [10.0.0.0/8], status: 451}}
upstreams:
  greeter: {{targets: ["http://{target}"], protocol: h2c, probe: false, timeout: 300ms}}
  gone: {{targets: ["http://127.0.0.1:{dead}"], protocol: h2c, probe: false}}
routes:
  - {{name: slow, match: {{path: /test.Echo/Slow}}, upstream: greeter}}
  - {{name: keyed, match: {{path: /test.Echo/Unary}}, upstream: greeter, key: header:x-api-key}}
  - {{name: gone, match: {{path_prefix: /test.Gone/}}, upstream: gone}}
"#
    );
    let gw = start_gateway(&yaml).await;
    let via = gw.addr.to_string();
    let unary = |method: &str, request: &str, metadata: Value| json!({"call": "unary", "method": method, "request": request, "metadata": metadata});
    let cases = [
        (
            unary("/test.Echo/Unary", "hi", json!([["x-api-key", "blocked"]])),
            "PERMISSION_DENIED",
            "access denied",
        ),
        (
            unary(
                "/test.Echo/Unary",
                "hi",
                json!([["x-api-key", "k1"], ["x-forwarded-for", "10.1.2.3"]]),
            ),
            "PERMISSION_DENIED",
            "access denied",
        ),
        (
            unary("/test.Echo/Unary", "hi", json!([])),
            "UNAUTHENTICATED",
            "missing header x-api-key (absent, empty or sent more than once): this route needs it to identify the client",
        ),
        (
            unary("/test.Nowhere/Call", "hi", json!([])),
            "UNIMPLEMENTED",
            "no route matches this request",
        ),
        (
            unary("/test.Gone/Call", "hi", json!([])),
            "UNAVAILABLE",
            "upstream unavailable",
        ),
        (
            unary("/test.Echo/Slow", "10000", json!([])),
            "DEADLINE_EXCEEDED",
            "upstream did not answer in time",
        ),
    ];
    // At once: each is a client process of its own.
    let answers = join_all(cases.iter().map(|(spec, _, _)| call(&via, spec))).await;
    for ((spec, code, details), c) in cases.iter().zip(answers) {
        assert_eq!(
            (c.code.as_str(), c.details.as_str(), &c.initial, &c.trailing),
            (*code, *details, &vec![], &vec![]),
            "{spec}"
        );
    }
    // The upstream's call, cut by sluice at its timeout.
    let end = server.ended("Slow").await;
    assert_eq!(end["cancelled"], true, "{end}");
    assert!(end["ms"].as_u64().unwrap() < 1000, "{end}");
    assert!(server.events("call", "Unary").is_empty());

    let r = raw_call(&via, "/test.Echo/Unary", &[("x-api-key", "blocked")], b"hi").await;
    assert_eq!(r.status, 200);
    assert_eq!(
        names(&r),
        ["content-type", "date", "grpc-message", "grpc-status"],
        "{r:?}"
    );
    assert_eq!(r.header("content-type"), Some("application/grpc"));
    assert_eq!(r.header("grpc-status"), Some("7"));
    assert_eq!(r.header("grpc-message"), Some("access denied"));
    assert_eq!((r.body.len(), &r.trailers), (0, &None), "{r:?}");

    let m = metrics(gw.admin_addr).await;
    assert_eq!(
        decisions(&m, "keyed"),
        [("bad_request", 1.0), ("denied", 3.0)]
    );
    assert_eq!(decisions(&m, "unmatched"), [("unmatched", 1.0)]);
    assert_eq!(decisions(&m, "gone"), [("allowed", 1.0)]);
    assert_eq!(decisions(&m, "slow"), [("allowed", 1.0)]);
    for (series, n) in [
        (
            r#"sluice_upstream_errors_total{kind="connect",route="gone"}"#,
            1.0,
        ),
        (
            r#"sluice_upstream_errors_total{kind="timeout",route="slow"}"#,
            1.0,
        ),
    ] {
        assert_eq!(metric(&m, series), Some(n), "{series}");
    }
}

/// Redis unreachable under `on_error: deny`: UNAVAILABLE, counted as
/// `store_error_denied`; nothing reaches the upstream.
#[tokio::test]
async fn a_store_down_under_on_error_deny_is_unavailable() {
    let server = GrpcServer::start().await;
    // Nothing listens there.
    let redis = format!("redis://127.0.0.1:{}", free_port());
    let routes = "  - name: say\n    match: {path: /test.Echo/Unary}\n    upstream: greeter\n    \
                  key: header:x-api-key\n    \
                  limits: [{name: calls, algorithm: fixed_window, limit: 3, window: 1s}]\n";
    let yaml = format!(
        "store:\n  backend: redis\n  redis: {{url: \"{redis}\", timeout: 200ms}}\n  on_error: deny\n{}",
        config(&server.target(), "", routes)
    );
    let gw = start_gateway(&yaml).await;
    let spec = json!({"call": "unary", "method": "/test.Echo/Unary", "request": "hi",
                      "metadata": [["x-api-key", "k1"]]});
    let c = call(&gw.addr.to_string(), &spec).await;
    assert_eq!(
        (c.code.as_str(), c.details.as_str(), &c.trailing),
        (
            "UNAVAILABLE",
            "rate limiter unavailable; try again later",
            &vec![]
        )
    );
    assert!(server.events("call", "Unary").is_empty());
    let m = metrics(gw.admin_addr).await;
    assert_eq!(decisions(&m, "say"), [("store_error_denied", 1.0)]);
}

/// A client stream that grows past `server.max_request_body` is refused with
/// RESOURCE_EXHAUSTED, and the upstream's call ends.
#[tokio::test]
async fn a_client_stream_over_max_request_body_is_resource_exhausted() {
    let server = GrpcServer::start().await;
    let yaml = format!(
        "server: {{listen: \"127.0.0.1:0\", max_request_body: 64KiB}}\n{}",
        config(&server.target(), "", ECHO)
    );
    let gw = start_gateway(&yaml).await;
    let spec = json!({"call": "client_stream", "method": "/test.Echo/ClientStream",
                      "timeout": 10, "messages": vec![json!({"pattern": 16 * 1024}); 8]});
    let c = call(&gw.addr.to_string(), &spec).await;
    assert_eq!(
        (c.code.as_str(), c.details.as_str(), c.received),
        ("RESOURCE_EXHAUSTED", "request body too large", 0)
    );
    // The server never took the whole stream: sluice resets the upstream's stream
    // at the limit. grpcio may still record the call: its request iterator ends
    // quietly when a receive finds the stream gone before it has seen the reset
    // (`_receive_message` marks the client closed, not cancelled), so the
    // handler returns with what came before it, never more than the limit.
    for seen in server.events("call", "ClientStream") {
        assert!(seen["bytes"].as_u64().unwrap() < 64 * 1024, "{seen}");
        assert!(seen["count"].as_u64().unwrap() < 4, "{seen}");
    }
    let m = metrics(gw.admin_addr).await;
    assert_eq!(decisions(&m, "echo"), [("bad_request", 1.0)]);
}

// === TLS ===

/// TLS on both legs: a gRPC client to sluice's `server.tls` (h2 by ALPN), sluice
/// to a gRPC server with `protocol: h2` (a private CA, `tls_ca`). A unary call and
/// a ping-pong pass through; the upstream sees `X-Forwarded-Proto: https`.
#[tokio::test]
async fn grpc_passes_through_tls_on_both_legs() {
    let certs = self_signed();
    let server = GrpcServer::start_tls(&certs).await;
    let (cert, key) = (certs.cert_pem.path(), certs.key_pem.path());
    let yaml = format!(
        r#"
server: {{listen: "127.0.0.1:0", tls: {{cert: "{cert}", key: "{key}"}}}}
upstreams:
  greeter: {{targets: ["https://127.0.0.1:{port}"], protocol: h2, probe: false, tls_ca: "{cert}"}}
routes:
{ECHO}"#,
        cert = cert.display(),
        key = key.display(),
        port = server.port,
    );
    let gw = start_gateway(&yaml).await;
    let via = gw.addr.to_string();
    let ca = cert.to_str().unwrap();
    let c = call(
        &via,
        &json!({"call": "unary", "method": "/test.Echo/Unary", "request": "over tls",
                "ca": ca}),
    )
    .await;
    assert_eq!(
        (c.code.as_str(), json!(c.replies)),
        ("OK", json!(["over tls"]))
    );
    let c = call(
        &via,
        &json!({"call": "bidi", "method": "/test.Echo/Bidi", "timeout": 10,
                "messages": ["a", "b", "c"], "ca": ca}),
    )
    .await;
    assert_eq!(
        (c.code.as_str(), json!(c.replies)),
        ("OK", json!(["a", "b", "c"]))
    );
    let seen = &server.events("call", "Unary")[0]["metadata"];
    assert_eq!(
        (&seen["x-forwarded-for"], &seen["x-forwarded-proto"]),
        (&json!("127.0.0.1"), &json!("https"))
    );
    let m = metrics(gw.admin_addr).await;
    assert_eq!(decisions(&m, "echo"), [("allowed", 2.0)]);
}
