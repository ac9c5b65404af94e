//! Upstream answers as servers write them (capitalised names, `name:value`, repeated
//! fields, hop-by-hop ones, a `Connection` last), through the plain-request server
//! and through hyper's: the client gets the same bytes from both, rate-limit
//! fields included. (The plain-request server writes the fields of most answers
//! as they came, without a header map in between: this holds it to what the map
//! gives; a 204 or 304 with a length goes through the map after all.)

use crate::common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The answer the upstream gives to a request for `path` (GET; a HEAD gets the
/// head alone), and whether it closes after it.
fn upstream_answer(path: &str) -> (String, bool) {
    let many: String = (0..20).map(|i| format!("X-Field-{i}: v{i}\r\n")).collect();
    let (head, body, close) = match path {
        "/nginx" => (
            "HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Sun, 22 Nov 2026 10:00:00 GMT\r\nContent-Type: text/plain\r\nContent-Length: 3\r\nConnection: keep-alive\r\n\r\n".to_owned(),
            "ok\n",
            false,
        ),
        "/nodate" => (
            "HTTP/1.1 201 Created\r\nX-Mixed-Case: Value\r\nLocation: /things/7\r\nContent-Length: 5\r\n\r\n".to_owned(),
            "hello",
            false,
        ),
        "/spaced" => (
            "HTTP/1.1 200 OK\r\nContent-Type:text/plain\r\nX-A:   padded  \r\nContent-Length: 3\r\n\r\n".to_owned(),
            "ok\n",
            false,
        ),
        "/repeat" => (
            "HTTP/1.1 200 OK\r\nSet-Cookie: a=1\r\nX-B: 1\r\nSet-Cookie: b=2\r\nContent-Length: 3\r\n\r\n".to_owned(),
            "ok\n",
            false,
        ),
        "/close" => (
            "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\n".to_owned(),
            "ok\n",
            true,
        ),
        "/hop" => (
            "HTTP/1.1 200 OK\r\nKeep-Alive: timeout=5\r\nContent-Length: 3\r\n\r\n".to_owned(),
            "ok\n",
            false,
        ),
        "/rate" => (
            "HTTP/1.1 200 OK\r\nRateLimit: \"up\";r=1;t=1\r\nContent-Length: 3\r\n\r\n".to_owned(),
            "ok\n",
            false,
        ),
        "/zero" => ("HTTP/1.1 200 OK\r\nServer: s\r\nContent-Length: 0\r\n\r\n".to_owned(), "", false),
        "/chunked" => (
            "HTTP/1.1 200 OK\r\nServer: s\r\nTransfer-Encoding: chunked\r\n\r\n".to_owned(),
            "3\r\nok\n\r\n0\r\n\r\n",
            false,
        ),
        "/http10" => ("HTTP/1.0 200 OK\r\nServer: s\r\nContent-Length: 3\r\n\r\n".to_owned(), "ok\n", true),
        "/connlist" => (
            "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: keep-alive, x-foo\r\nX-Foo: 1\r\nX-Bar: 2\r\n\r\n".to_owned(),
            "ok\n",
            false,
        ),
        "/404" => (
            "HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n".to_owned(),
            "{}",
            false,
        ),
        "/reason" => ("HTTP/1.1 200 Fine\r\nServer: s\r\nContent-Length: 3\r\n\r\n".to_owned(), "ok\n", false),
        "/many" => (format!("HTTP/1.1 200 OK\r\n{many}Content-Length: 3\r\n\r\n"), "ok\n", false),
        "/trailer" => (
            "HTTP/1.1 200 OK\r\nTrailer: x-sum\r\nContent-Length: 3\r\n\r\n".to_owned(),
            "ok\n",
            false,
        ),
        // No body, whatever the length says: read for their heads alone.
        "/notmod" => (
            "HTTP/1.1 304 Not Modified\r\nETag: \"x\"\r\nContent-Length: 5\r\n\r\n".to_owned(),
            "",
            false,
        ),
        "/nocontent" => (
            "HTTP/1.1 204 No Content\r\nServer: s\r\nContent-Length: 5\r\n\r\n".to_owned(),
            "",
            false,
        ),
        _ => (
            "HTTP/1.1 200 OK\r\nServer: s\r\nDate: Sun, 22 Nov 2026 10:00:00 GMT\r\nContent-Length: 3\r\n\r\n".to_owned(),
            "ok\n",
            false,
        ),
    };
    (format!("{head}{body}"), close)
}

/// Serves each request on a connection with `upstream_answer`.
async fn serve(mut s: TcpStream) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
            continue;
        };
        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
        buf.drain(..end + 4);
        let mut first = head.split(' ');
        let (method, path) = (first.next().unwrap_or(""), first.next().unwrap_or(""));
        let (answer, close) = upstream_answer(path.strip_prefix("/limited").unwrap_or(path));
        let answer = if method == "HEAD" {
            answer[..answer.find("\r\n\r\n").unwrap() + 4].to_owned()
        } else {
            answer
        };
        if s.write_all(answer.as_bytes()).await.is_err() || close {
            return;
        }
    }
}

/// The head with the value of the `date` line sluice writes (it changes by the
/// second) left out; nothing else changed.
fn fixed_date(text: &str) -> String {
    text.split("\r\n")
        .map(|l| match l.strip_prefix("date: ") {
            Some(d) if d != "Sun, 22 Nov 2026 10:00:00 GMT" => "date: (now)",
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\r\n")
}

#[tokio::test]
async fn the_client_gets_each_upstream_answer_as_hyper_writes_it() {
    let (up, _) = raw_upstream(serve).await;
    let gw = start_gateway(&format!(
        r#"
upstreams:
  app: {{targets: ["http://{up}"]}}
routes:
  - name: limited
    match: {{path_prefix: /limited}}
    upstream: app
    key: header:x-key
    limits: [{{name: perkey, algorithm: gcra, rate: 1000/s, burst: 1000}}]
  - {{name: rest, match: {{path_prefix: /}}, upstream: app}}
"#
    ))
    .await;
    let paths = [
        "/nginx",
        "/nodate",
        "/spaced",
        "/repeat",
        "/close",
        "/hop",
        "/rate",
        "/zero",
        "/chunked",
        "/http10",
        "/connlist",
        "/404",
        "/reason",
        "/many",
        "/trailer",
        "/notmod",
        "/nocontent",
        "/other",
    ];
    let requests = [
        "GET {p} HTTP/1.1\r\nhost: h\r\nx-key: k\r\n\r\n",
        "GET {p} HTTP/1.1\r\nhost: h\r\nx-key: k\r\nconnection: close\r\n\r\n",
        "GET {p} HTTP/1.0\r\nhost: h\r\nx-key: k\r\n\r\n",
        "GET {p} HTTP/1.0\r\nhost: h\r\nx-key: k\r\nconnection: keep-alive\r\n\r\n",
        "HEAD {p} HTTP/1.1\r\nhost: h\r\nx-key: k\r\n\r\n",
    ];
    let mut compared = 0;
    for prefix in ["", "/limited"] {
        for path in paths {
            for req in requests {
                // A key of its own for each, so both get the same remaining count.
                let req = req.replace("{p}", &format!("{prefix}{path}"));
                let fast_req = req.replace("x-key: k", &format!("x-key: {compared}-fast"));
                let slow_req = req.replace("x-key: k", &format!("x-key: {compared}-slow"));
                let mut fast = connect(gw.addr).await;
                let mut slow = hyper_connection(gw.addr).await;
                let head_only =
                    req.starts_with("HEAD") || ["/notmod", "/nocontent"].contains(&path);
                let (fast_text, hyper_text) = if head_only {
                    fast.write_all(fast_req.as_bytes()).await.expect("write");
                    slow.write_all(slow_req.as_bytes()).await.expect("write");
                    (
                        read_head(&mut fast).await.expect("a head"),
                        read_head(&mut slow).await.expect("a head"),
                    )
                } else {
                    fast.write_all(fast_req.as_bytes()).await.expect("write");
                    slow.write_all(slow_req.as_bytes()).await.expect("write");
                    let (fh, fb) = read_response(&mut fast).await.expect("an answer");
                    let (sh, sb) = read_response(&mut slow).await.expect("an answer");
                    (format!("{fh}{fb}"), format!("{sh}{sb}"))
                };
                assert_eq!(fixed_date(&fast_text), fixed_date(&hyper_text), "{req}");
                if prefix == "/limited" {
                    assert!(
                        fast_text.contains("\r\nratelimit: \"perkey\";r="),
                        "{fast_text}"
                    );
                }
                compared += 1;
            }
        }
    }
    assert_eq!(compared, 2 * 18 * 5);
    gw.shutdown().await;
}
