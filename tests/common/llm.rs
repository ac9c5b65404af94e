//! An LLM-shaped upstream for the token-metered tests (`cost: {response_json}`):
//! OpenAI- and Anthropic-shaped JSON and event streams, streams held after their
//! first event until the test lets them go on; and a client that reads a stream
//! as it arrives.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use super::bounded;

// === the upstream ===

/// An LLM-shaped upstream: `/v1/json?t=N` answers OpenAI's JSON with `N` total
/// tokens; `/v1/openai?t=N` streams a first event, waits for the gate, then the
/// usage event and `[DONE]`; `/v1/anthropic?in=A&out=B` streams `message_start`
/// (A input tokens), waits, then two `message_delta`s (3, then B output tokens);
/// `/v1/odd?t=N` streams a non-JSON event, an event over sluice's bound, a
/// malformed one and the usage; `/v1/bad` is a JSON body that is not JSON;
/// `/v1/close` closes the connection without an answer.
pub struct Llm {
    addr: SocketAddr,
    /// A held stream goes on once per permit.
    gate: Arc<Semaphore>,
    hits: Arc<std::sync::atomic::AtomicUsize>,
}

impl Llm {
    pub async fn start() -> Llm {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let gate = Arc::new(Semaphore::new(0));
        let hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (g, h) = (gate.clone(), hits.clone());
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                tokio::spawn(serve(conn, g.clone(), h.clone()));
            }
        });
        Llm { addr, gate, hits }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// One held stream goes on.
    pub fn release(&self) {
        self.gate.add_permits(1);
    }

    pub fn hits(&self) -> usize {
        self.hits.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// One upstream connection: requests answered in turn.
async fn serve(
    mut conn: TcpStream,
    gate: Arc<Semaphore>,
    hits: Arc<std::sync::atomic::AtomicUsize>,
) {
    let mut buf = Vec::new();
    loop {
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 4096];
            match conn.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
        let length: usize = head
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse().ok())
                    .flatten()
            })
            .unwrap_or(0);
        while buf.len() < head_end + length {
            let mut chunk = [0u8; 4096];
            match conn.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        buf.drain(..head_end + length);
        hits.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let target = head.split(' ').nth(1).unwrap_or("/").to_string();
        let (path, query) = target.split_once('?').unwrap_or((&target, ""));
        let q = |name: &str| -> u64 {
            query
                .split('&')
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
                .unwrap_or(0)
        };
        let ok = match path {
            "/v1/json" => {
                let t = q("t");
                let body = format!(
                    r#"{{"id":"chatcmpl-1","object":"chat.completion","usage":{{"prompt_tokens":1,"completion_tokens":{},"total_tokens":{t}}}}}"#,
                    t.saturating_sub(1)
                );
                full(&mut conn, "application/json", body.as_bytes()).await
            }
            "/v1/bad" => {
                full(
                    &mut conn,
                    "application/json",
                    br#"{"usage":{"total_tokens":5"#,
                )
                .await
            }
            "/v1/openai" => {
                let t = q("t");
                let last = format!(
                    "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":1,\"completion_tokens\":{},\"total_tokens\":{t}}}}}\n\ndata: [DONE]\n\n",
                    t.saturating_sub(1)
                );
                stream(
                    &mut conn,
                    &[b"data: {\"choices\":[{\"delta\":{\"content\":\"first\"}}],\"usage\":null}\n\n", last.as_bytes()],
                    &gate,
                )
                .await
            }
            "/v1/anthropic" => {
                let start = format!(
                    "event: message_start\ndata: {{\"type\":\"message_start\",\"message\":{{\"usage\":{{\"input_tokens\":{},\"output_tokens\":1}}}}}}\n\n",
                    q("in")
                );
                let rest = format!(
                    "event: message_delta\ndata: {{\"type\":\"message_delta\",\"usage\":{{\"output_tokens\":3}}}}\n\n\
                     event: message_delta\ndata: {{\"type\":\"message_delta\",\"usage\":{{\"output_tokens\":{}}}}}\n\n\
                     event: message_stop\ndata: {{\"type\":\"message_stop\"}}\n\n",
                    q("out")
                );
                stream(&mut conn, &[start.as_bytes(), rest.as_bytes()], &gate).await
            }
            // Not held: every event at once, in chunks of every size.
            "/v1/odd" => stream_unheld(&mut conn, &odd_stream(q("t"))).await,
            // No answer at all: sluice answers 502 itself.
            "/v1/close" => false,
            _ => full(&mut conn, "text/plain", b"no such path\n").await,
        };
        if !ok {
            return;
        }
    }
}

async fn full(conn: &mut TcpStream, content_type: &str, body: &[u8]) -> bool {
    let head = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    conn.write_all(&[head.as_bytes(), body].concat())
        .await
        .is_ok()
}

/// A chunked event stream: the first event, then (once the gate lets it) the rest.
async fn stream(conn: &mut TcpStream, parts: &[&[u8]], gate: &Semaphore) -> bool {
    let head =
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n";
    if conn
        .write_all(&[head.as_bytes(), &chunk(parts[0])].concat())
        .await
        .is_err()
    {
        return false;
    }
    match gate.acquire().await {
        Ok(p) => p.forget(),
        Err(_) => return false,
    }
    for p in &parts[1..] {
        if conn.write_all(&chunk(p)).await.is_err() {
            return false;
        }
    }
    conn.write_all(b"0\r\n\r\n").await.is_ok()
}

/// `/v1/odd`'s events: a comment, an event that is not JSON, one longer than
/// sluice reads (with a usage that must not count), a malformed one, the usage of
/// `t` tokens and `[DONE]`.
pub fn odd_stream(t: u64) -> Vec<u8> {
    let mut huge = b"data: {\"pad\":\"".to_vec();
    huge.resize(300 * 1024, b'x');
    huge.extend_from_slice(b"\",\"usage\":{\"total_tokens\":99999}}\n\n");
    let usage = format!("data: {{\"usage\":{{\"total_tokens\":{t}}}}}\n\n");
    [
        &b": keep-alive\n\ndata: hello, not JSON\n\n"[..],
        &huge,
        b"data: {\"usage\":{\"total_tokens\":\n\n",
        usage.as_bytes(),
        b"data: [DONE]\n\n",
    ]
    .concat()
}

async fn stream_unheld(conn: &mut TcpStream, all: &[u8]) -> bool {
    let head =
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n";
    let mut out = head.as_bytes().to_vec();
    // Chunks of 1, 2, 3, ... bytes, then the rest: events split everywhere.
    let (mut at, mut n) = (0, 1);
    while at < all.len() {
        let end = (at + n).min(all.len());
        out.extend_from_slice(&chunk(&all[at..end]));
        at = end;
        n = if n < 64 { n + 1 } else { 64 * 1024 };
    }
    out.extend_from_slice(b"0\r\n\r\n");
    conn.write_all(&out).await.is_ok()
}

fn chunk(data: &[u8]) -> Vec<u8> {
    [format!("{:x}\r\n", data.len()).as_bytes(), data, b"\r\n"].concat()
}

// === a client that reads a stream as it comes ===

/// A request to the gateway on a connection of its own, its answer read as it
/// arrives.
pub struct Streamed {
    conn: TcpStream,
    got: Vec<u8>,
}

impl Streamed {
    pub async fn post(gw: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Streamed {
        let mut conn = TcpStream::connect(gw).await.unwrap();
        let fields: String = headers
            .iter()
            .map(|(k, v)| format!("{k}: {v}\r\n"))
            .collect();
        let req = format!("POST {path} HTTP/1.1\r\nHost: llm\r\n{fields}Content-Length: 0\r\n\r\n");
        conn.write_all(req.as_bytes()).await.unwrap();
        Streamed {
            conn,
            got: Vec::new(),
        }
    }

    /// Reads until `needle` has arrived (within a bound: it must come without the
    /// upstream sending anything more).
    pub async fn until(&mut self, needle: &str) {
        let read = async {
            while !String::from_utf8_lossy(&self.got).contains(needle) {
                let mut buf = [0u8; 4096];
                let n = self.conn.read(&mut buf).await.unwrap();
                assert!(
                    n > 0,
                    "closed before {needle:?}: {:?}",
                    String::from_utf8_lossy(&self.got)
                );
                self.got.extend_from_slice(&buf[..n]);
            }
        };
        bounded(needle, read).await;
    }

    /// The answer's status and `X-RateLimit-Remaining` (once its head has come).
    pub fn head(&self) -> (u16, u64) {
        let text = String::from_utf8_lossy(&self.got);
        let status = text.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap();
        let remaining = text
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("x-ratelimit-remaining")
                    .then(|| v.trim().parse().ok())
                    .flatten()
            })
            .unwrap();
        (status, remaining)
    }
}
