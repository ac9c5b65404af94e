//! Reading a request body for a key in it (`form:NAME`, `json:/POINTER`): before
//! the decision, at most `server.max_key_body` of it held, and the body then
//! forwarded byte for byte, whether it fit or not.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::Body as _;
use http_body_util::BodyExt;

use crate::http::request::{ClientBody, ReadBody};
use crate::upstream::ClientFault;

/// A request body read for its key.
pub struct KeyBody {
    /// The whole body, when it has at most `max_key_body` bytes; None when it is
    /// larger (a body key part is then missing).
    pub bytes: Option<Bytes>,
    /// The body to forward: every byte the client sent, in order, then its
    /// trailers.
    pub body: ClientBody,
}

/// Reads `body` until it ends or has given more than `max_key_body` bytes.
///
/// A body that ends within `max_key_body` gives its bytes, and a body that gives
/// them again (and its trailers). A larger one gives `bytes: None` and a body
/// that gives the bytes already read, then the rest as the client sends it: the
/// request still goes upstream whole, within `max_request_body` as any other. A
/// body whose `Content-Length` is already over `max_key_body` is not read at all,
/// and an empty body gives no bytes (`Some` of none).
///
/// Reading the body answers an `Expect: 100-continue` (sluice's HTTP/1 server
/// sends `100 Continue` when the body is first asked for), as the upstream's
/// read-ahead does. Each wait for more of the body is bounded by `timeout`
/// (`server.request_body_timeout`, the time between two reads, as when it is
/// forwarded); a body that stalls, breaks its framing or is cut short gives the
/// `ClientFault` to answer (408 or 400, as `Refusal::Client`), and nothing is
/// forwarded.
///
/// The request path calls it in `pipeline::pass`, after the deny by IP, the route
/// and the `Content-Length` check against `max_request_body` (so that a body too
/// large to forward is refused before it is read), and hands the bytes to
/// `client_key` for each key the route counts; the body is what `act` forwards.
pub async fn read(
    mut body: ClientBody,
    max_key_body: u64,
    timeout: Duration,
) -> Result<KeyBody, ClientFault> {
    if body.is_end_stream() {
        return Ok(KeyBody {
            bytes: Some(Bytes::new()),
            body,
        });
    }
    let hint = body.size_hint();
    if hint.lower() > max_key_body {
        return Ok(KeyBody { bytes: None, body });
    }
    let capacity = hint.exact().unwrap_or(0).min(max_key_body);
    let mut read = BytesMut::with_capacity(usize::try_from(capacity).unwrap_or(0));
    let mut trailers = None;
    while !body.is_end_stream() {
        let frame = match tokio::time::timeout(timeout, body.frame()).await {
            Err(_) => return Err(ClientFault::Timeout),
            Ok(None) => break,
            Ok(Some(Err(e))) => return Err(ClientFault::of(&e)),
            Ok(Some(Ok(frame))) => frame,
        };
        match frame.into_data() {
            Ok(data) => read.extend_from_slice(&data),
            Err(frame) => trailers = frame.into_trailers().ok(),
        }
        if read.len() as u64 > max_key_body {
            let body = ReadBody::new(read.freeze(), None, Some(body), hint);
            return Ok(KeyBody {
                bytes: None,
                body: ClientBody::Read(Box::new(body)),
            });
        }
    }
    let read = read.freeze();
    Ok(KeyBody {
        bytes: Some(read.clone()),
        body: ClientBody::Read(Box::new(ReadBody::new(read, trailers, None, hint))),
    })
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use http::HeaderMap;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

    use super::*;
    use crate::http::request::http1_body_for_tests;

    const WAIT: Duration = Duration::from_secs(5);

    /// A body as sluice's HTTP/1 server reads it (`length`: its `Content-Length`,
    /// or chunked), and the client's end of its connection.
    fn h1(length: Option<u64>, expect_continue: bool) -> (ClientBody, DuplexStream) {
        http1_body_for_tests(length, expect_continue)
    }

    /// Everything a body gives: its bytes and its trailers.
    async fn forwarded(body: ClientBody) -> (Vec<u8>, Option<HeaderMap>) {
        let all = body.collect().await.expect("the body");
        let trailers = all.trailers().cloned();
        (all.to_bytes().to_vec(), trailers)
    }

    fn hint(body: &ClientBody) -> (u64, Option<u64>) {
        let h = body.size_hint();
        (h.lower(), h.upper())
    }

    #[tokio::test]
    async fn a_body_within_the_limit_is_read_whole_and_forwarded_as_sent() {
        let (body, mut client) = h1(Some(14), false);
        client.write_all(b"username=alice").await.unwrap();
        let k = read(body, 14, WAIT).await.unwrap();
        assert_eq!(k.bytes.as_deref(), Some(&b"username=alice"[..]));
        // The client's framing: its length, and not over before it is forwarded.
        assert_eq!(hint(&k.body), (14, Some(14)));
        assert!(!k.body.is_end_stream());
        assert_eq!(forwarded(k.body).await, (b"username=alice".to_vec(), None));
    }

    #[tokio::test]
    async fn a_chunked_body_within_the_limit_keeps_its_trailers() {
        let (body, mut client) = h1(None, false);
        client
            .write_all(b"4\r\nuser\r\n6\r\nname=a\r\n0\r\nx-sum: 8\r\n\r\n")
            .await
            .unwrap();
        let k = read(body, 64, WAIT).await.unwrap();
        assert_eq!(k.bytes.as_deref(), Some(&b"username=a"[..]));
        assert_eq!(hint(&k.body), (0, None), "stays chunked");
        let (bytes, trailers) = forwarded(k.body).await;
        assert_eq!(bytes, b"username=a");
        assert_eq!(trailers.unwrap()["x-sum"], "8");
    }

    #[tokio::test]
    async fn empty_bodies_give_no_bytes() {
        let k = read(ClientBody::Empty, 64, WAIT).await.unwrap();
        assert_eq!(k.bytes.as_deref(), Some(&b""[..]));
        assert!(matches!(k.body, ClientBody::Empty));
        let (body, mut client) = h1(None, false);
        client.write_all(b"0\r\n\r\n").await.unwrap();
        let k = read(body, 64, WAIT).await.unwrap();
        assert_eq!(k.bytes.as_deref(), Some(&b""[..]));
        assert_eq!(forwarded(k.body).await, (Vec::new(), None));
    }

    /// A body announced larger than the limit is not read: it goes on as it came.
    #[tokio::test]
    async fn a_length_over_the_limit_is_not_read() {
        let (body, mut client) = h1(Some(11), false);
        let k = read(body, 10, WAIT).await.unwrap();
        assert_eq!(k.bytes, None);
        assert!(matches!(k.body, ClientBody::Own(_)));
        client.write_all(b"hello world").await.unwrap();
        assert_eq!(forwarded(k.body).await, (b"hello world".to_vec(), None));
    }

    /// A body that grows past the limit: what was read, then the rest as the client
    /// sends it (after the key was decided), every byte in order.
    #[tokio::test]
    async fn a_body_over_the_limit_is_forwarded_whole_and_in_order() {
        let (body, mut client) = h1(None, false);
        client
            .write_all(b"8\r\n01234567\r\n8\r\n89abcdef\r\n")
            .await
            .unwrap();
        let k = read(body, 10, WAIT).await.unwrap();
        assert_eq!(k.bytes, None);
        assert_eq!(hint(&k.body), (0, None), "stays chunked");
        // The rest comes only now: the read did not wait for it.
        client
            .write_all(b"8\r\nghijklmn\r\n0\r\nx-sum: 3\r\n\r\n")
            .await
            .unwrap();
        let (bytes, trailers) = forwarded(k.body).await;
        assert_eq!(bytes, b"0123456789abcdefghijklmn");
        assert_eq!(trailers.unwrap()["x-sum"], "3");

        // A length-framed one, a byte over.
        let (body, mut client) = h1(Some(11), false);
        client.write_all(b"hello world").await.unwrap();
        let k = read(body, 12, WAIT).await.unwrap();
        assert_eq!(k.bytes.as_deref(), Some(&b"hello world"[..]), "fits");
        let (body, mut client) = h1(Some(40_000), false);
        let sent: Vec<u8> = (0..40_000u32).map(|i| (i % 251) as u8).collect();
        client.write_all(&sent).await.unwrap();
        let k = read(body, 20_000, WAIT).await.unwrap();
        assert_eq!(k.bytes, None);
        assert_eq!(hint(&k.body), (40_000, Some(40_000)));
        assert_eq!(forwarded(k.body).await, (sent, None));
    }

    /// A client waiting for `100 Continue` gets it when the body is read for its key.
    #[tokio::test]
    async fn reading_answers_expect_continue() {
        let (body, mut client) = h1(Some(5), true);
        let reading = tokio::spawn(read(body, 64, WAIT));
        let mut continued = [0u8; 25];
        client.read_exact(&mut continued).await.unwrap();
        assert_eq!(&continued, b"HTTP/1.1 100 Continue\r\n\r\n");
        client.write_all(b"u=bob").await.unwrap();
        let k = reading.await.unwrap().unwrap();
        assert_eq!(k.bytes.as_deref(), Some(&b"u=bob"[..]));
    }

    /// A client that stops sending fails the read after `timeout` of silence, not
    /// sooner and not much later; one that goes away or breaks its framing fails it
    /// at once.
    #[tokio::test]
    async fn a_stalled_cut_or_malformed_body_fails_the_read() {
        let timeout = Duration::from_millis(300);
        let (body, mut client) = h1(Some(10), false);
        client.write_all(b"user").await.unwrap();
        let started = Instant::now();
        assert_eq!(
            read(body, 64, timeout).await.err(),
            Some(ClientFault::Timeout)
        );
        let took = started.elapsed();
        assert!(took >= timeout && took < timeout * 4, "{took:?}");
        drop(client);

        let (body, mut client) = h1(Some(10), false);
        client.write_all(b"user").await.unwrap();
        drop(client);
        assert_eq!(read(body, 64, WAIT).await.err(), Some(ClientFault::Aborted));

        let (body, mut client) = h1(None, false);
        client.write_all(b"zz\r\nuser\r\n").await.unwrap();
        assert_eq!(
            read(body, 64, WAIT).await.err(),
            Some(ClientFault::Malformed)
        );
    }

    /// A body that does not tell its length (sent without `content-length`).
    struct Unsized(http_body_util::Full<Bytes>);

    impl http_body::Body for Unsized {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
            std::pin::Pin::new(&mut self.0).poll_frame(cx)
        }
    }

    /// HTTP/2 bodies (hyper's): within the limit, and over it by more than a
    /// stream's flow-control window (64KiB), which the read must keep open.
    #[tokio::test]
    async fn http2_bodies() {
        use http_body_util::Full;
        use hyper_util::rt::{TokioExecutor, TokioIo};

        let (client_io, server_io) = tokio::io::duplex(256 * 1024);
        let service =
            hyper::service::service_fn(|req: http::Request<hyper::body::Incoming>| async {
                let k = read(ClientBody::Hyper(req.into_body()), 70_000, WAIT)
                    .await
                    .map_err(|f| f.to_string())?;
                let read = k.bytes.map_or("none".to_string(), |b| b.len().to_string());
                let hint = format!("{:?}", hint(&k.body));
                let (bytes, _) = forwarded(k.body).await;
                let resp = http::Response::builder()
                    .header("x-read", read)
                    .header("x-hint", hint)
                    .body(Full::new(Bytes::from(bytes)))
                    .map_err(|e| e.to_string())?;
                Ok::<_, String>(resp)
            });
        tokio::spawn(
            hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(server_io), service),
        );
        let (mut send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(client_io))
                .await
                .unwrap();
        tokio::spawn(conn);

        // With a length, and without one (read until the limit is passed).
        for (len, length, read, hint) in [
            (1_000, true, "1000", "(1000, Some(1000))"),
            (70_000, false, "70000", "(0, None)"),
            (200_000, false, "none", "(0, None)"),
            (200_000, true, "none", "(200000, Some(200000))"),
        ] {
            let sent: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
            let mut req = http::Request::post("http://gw/login");
            if length {
                req = req.header("content-length", len);
            }
            let req = req
                .body(Unsized(Full::new(Bytes::from(sent.clone()))))
                .unwrap();
            let resp = send.send_request(req).await.unwrap();
            assert_eq!(resp.headers()["x-read"], read, "{len}");
            assert_eq!(resp.headers()["x-hint"], hint, "{len}");
            let got = resp.into_body().collect().await.unwrap().to_bytes();
            assert!(got == sent, "{len}: the body came back changed");
        }
    }
}
