//! The fields an upstream receives, in order and exactly: the client's (hop-by-hop
//! ones gone, `Host` and `X-Forwarded-*` the client sent replaced where they
//! stood), then the `X-Forwarded-*` sluice adds, then what framing adds; from a
//! trusted proxy and from anyone else, on plain requests and on hyper's.

use crate::common::*;
use tokio::io::AsyncWriteExt;

/// The fields the upstream got for `req`, sent on a fresh connection, as
/// `name: value` (lower-case names, in order).
async fn received(gw: &Running, req: &str) -> Vec<String> {
    let mut s = connect(gw.addr).await;
    s.write_all(req.as_bytes()).await.expect("write");
    let (head, body) = read_response(&mut s).await.expect("an answer");
    assert!(head.starts_with("HTTP/1."), "{head}");
    let echo: Echo = serde_json::from_str(&body).unwrap_or_else(|_| panic!("{head}{body}"));
    echo.headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}"))
        .collect()
}

fn lines(l: &[&str]) -> Vec<String> {
    l.iter().map(|s| s.to_string()).collect()
}

#[tokio::test]
async fn the_upstream_gets_the_fields_in_order() {
    let up = upstream().await;
    let config = |trusted: &str| {
        format!(
            "client_ip: {{trusted_proxies: [{trusted}]}}\nupstreams:\n  app: {{targets: [\"{}\"]}}\nroutes:\n  - {{name: rest, match: {{path_prefix: /}}, upstream: app}}\n",
            up.url()
        )
    };
    let untrusted = start_gateway(&config("10.9.9.9/32")).await;
    let trusted = start_gateway(&config("127.0.0.1/32")).await;
    let peer = "127.0.0.1";
    for (gw, trusted) in [(&untrusted, false), (&trusted, true)] {
        // A plain request.
        assert_eq!(
            received(gw, "GET /a HTTP/1.1\r\nHost: h\r\nX-A: 1\r\n\r\n").await,
            lines(&[
                "host: h",
                "x-a: 1",
                "x-forwarded-for: 127.0.0.1",
                "x-forwarded-proto: http",
                "x-forwarded-host: h",
            ]),
        );
        // The client's own, before `Host`.
        let req = "GET /a HTTP/1.1\r\nx-forwarded-proto: https\r\nX-Forwarded-For: 1.2.3.4\r\nx-forwarded-host: other\r\nHost: h\r\nX-A: 1\r\n\r\n";
        let got = received(gw, req).await;
        let (proto, host) = if trusted {
            ("https", "other")
        } else {
            ("http", "h")
        };
        assert_eq!(
            got,
            lines(&[
                &format!("x-forwarded-proto: {proto}"),
                &format!("x-forwarded-for: 1.2.3.4, {peer}"),
                &format!("x-forwarded-host: {host}"),
                "host: h",
                "x-a: 1",
            ]),
        );
        // Claims only a trusted proxy may make; a field `Connection` names.
        let req = "GET /a HTTP/1.1\r\nforwarded: for=1.1.1.1\r\nhost: h\r\nx-real-ip: 1.1.1.1\r\nconnection: x-b\r\nx-b: 2\r\nx-a: 1\r\nte: trailers\r\n\r\n";
        let got = received(gw, req).await;
        let expected = if trusted {
            lines(&[
                "forwarded: for=1.1.1.1",
                "host: h",
                "x-real-ip: 1.1.1.1",
                "x-a: 1",
                "te: trailers",
                "x-forwarded-for: 127.0.0.1",
                "x-forwarded-proto: http",
                "x-forwarded-host: h",
            ])
        } else {
            lines(&[
                "te: trailers",
                "host: h",
                "x-a: 1",
                "x-forwarded-for: 127.0.0.1",
                "x-forwarded-proto: http",
                "x-forwarded-host: h",
            ])
        };
        assert_eq!(got, expected, "trusted: {trusted}");
        // No `Host`: the target's, last.
        let got = received(gw, "GET /a HTTP/1.0\r\nx-a: 1\r\n\r\n").await;
        assert_eq!(
            got,
            lines(&[
                "x-a: 1",
                "x-forwarded-for: 127.0.0.1",
                "x-forwarded-proto: http",
                &format!("host: {}", up.addr),
            ]),
        );
        // Absolute form: its authority is the host.
        let got = received(gw, "GET http://abs.example/a HTTP/1.1\r\nhost: h\r\n\r\n").await;
        assert_eq!(
            got,
            lines(&[
                "host: abs.example",
                "x-forwarded-for: 127.0.0.1",
                "x-forwarded-proto: http",
                "x-forwarded-host: abs.example",
            ]),
        );
        // Bodies (hyper's): a length, and chunks.
        let got = received(
            gw,
            "POST /a HTTP/1.1\r\nhost: h\r\ncontent-length: 2\r\nx-a: 1\r\n\r\nhi",
        )
        .await;
        assert_eq!(
            got,
            lines(&[
                "host: h",
                "content-length: 2",
                "x-a: 1",
                "x-forwarded-for: 127.0.0.1",
                "x-forwarded-proto: http",
                "x-forwarded-host: h",
            ]),
        );
        let got = received(
            gw,
            "POST /a HTTP/1.1\r\nhost: h\r\ntransfer-encoding: chunked\r\nx-a: 1\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
        )
        .await;
        assert_eq!(
            got,
            lines(&[
                "host: h",
                "x-a: 1",
                "x-forwarded-for: 127.0.0.1",
                "x-forwarded-proto: http",
                "x-forwarded-host: h",
                "transfer-encoding: chunked",
            ]),
        );
    }
    untrusted.shutdown().await;
    trusted.shutdown().await;
}
