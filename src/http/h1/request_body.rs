//! An HTTP/1.1 request body as the gateway's own server reads it: framed by
//! `Content-Length` or chunked (RFC 9112 §6-7), decoded from the connection's
//! buffer. The connection keeps its socket and reads for the body only while the
//! body asks for a frame (`Inflow::poll_feed`), so an upload is read at the pace
//! the upstream takes it and never further than one read ahead.

use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use bytes::{Bytes, BytesMut};
use http_body::{Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::http::body::BoxError;
use crate::http::h1::decode::{Decoder, Step};

/// Room made for a read of body bytes.
const READ_SIZE: usize = 16 * 1024;

/// A body that breaks its framing: the client's fault (`ClientFault::Malformed`).
fn malformed(e: impl Into<BoxError>) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, e)
}

/// What the connection and its request's body share.
struct State {
    decode: Decoder,
    /// Chunk extension bytes so far.
    extensions: u64,
    /// A frame decoded, not yet taken.
    ready: Option<Frame<Bytes>>,
    /// The failure to give the body next.
    error: Option<std::io::Error>,
    /// The body failed: it gives nothing more.
    failed: bool,
    /// The body asked for a frame and waits for one.
    want: bool,
    body: Option<Waker>,
    conn: Option<Waker>,
    /// The body was dropped, or its connection took its socket back.
    gone: bool,
    /// `Expect: 100-continue`: the bytes of `100 Continue` still to write when the
    /// body is first asked for (None: not asked, or the answer has begun).
    expect: Option<usize>,
}

/// The connection's end of a request body.
#[derive(Clone)]
pub(crate) struct Inflow(Arc<Mutex<State>>);

/// How a request body stands, for its connection.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Settled {
    /// Read to its end.
    Done,
    /// Dropped before its end: the rest of it is unread.
    Dropped,
    /// Broken (malformed, or the client went away).
    Failed,
}

const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

impl Inflow {
    /// A body decoded by `decode`; `expect_continue` sends `100 Continue` when it
    /// is first asked for.
    pub(crate) fn new(decode: Decoder, expect_continue: bool) -> (Inflow, RequestBody) {
        let hint = match decode {
            Decoder::Length(n) => SizeHint::with_exact(n),
            _ => SizeHint::default(),
        };
        let state = Arc::new(Mutex::new(State {
            decode,
            extensions: 0,
            ready: None,
            error: None,
            failed: false,
            want: false,
            body: None,
            conn: None,
            gone: false,
            expect: expect_continue.then_some(0),
        }));
        (
            Inflow(state.clone()),
            RequestBody {
                state,
                hint,
                started: false,
            },
        )
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.0)
    }

    /// The answer's head is going out: no `100 Continue` after it (as hyper).
    pub(crate) fn answering(&self) {
        self.lock().expect = None;
    }

    /// Read and decode for the body while it asks for a frame. Ready once it
    /// needs nothing more from the connection; an error is the socket's, when
    /// writing `100 Continue`.
    pub(crate) fn poll_feed<IO>(
        &self,
        cx: &mut Context<'_>,
        io: &mut IO,
        buf: &mut BytesMut,
    ) -> Poll<std::io::Result<Settled>>
    where
        IO: AsyncRead + AsyncWrite + Unpin,
    {
        let mut st = self.lock();
        loop {
            if let Some(s) = st.settled() {
                return Poll::Ready(Ok(s));
            }
            if !st.want || st.ready.is_some() {
                st.conn = Some(cx.waker().clone());
                return Poll::Pending;
            }
            if let Some(at) = st.expect {
                if at == CONTINUE.len() {
                    st.expect = None;
                    continue;
                }
                match Pin::new(&mut *io).poll_write(cx, &CONTINUE[at..]) {
                    Poll::Ready(Ok(n)) if n > 0 => st.expect = Some(at + n),
                    Poll::Ready(Ok(_)) => {
                        return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()))
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => return Poll::Pending,
                }
                continue;
            }
            let st = &mut *st;
            match st.decode.step(buf, &mut st.extensions).map_err(malformed) {
                Ok(Step::Frame(f)) => st.ready = Some(f),
                Ok(Step::End) => st.decode = Decoder::Done,
                Err(e) => st.error = Some(e),
                Ok(Step::More) => match poll_read_buf(io, cx, buf) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Ok(0)) => {
                        st.error = Some(std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            "the client closed its connection mid-body",
                        ))
                    }
                    Poll::Ready(Ok(_)) => continue,
                    Poll::Ready(Err(e)) => st.error = Some(e),
                },
            }
            st.want = false;
            if let Some(w) = st.body.take() {
                w.wake();
            }
        }
    }

    /// The answer has been written: the connection takes its socket back. A body
    /// not yet read to its end is finished from what is buffered, if it is there
    /// (as hyper drains one); else it is left unread (the connection must close).
    pub(crate) fn finish(&self, buf: &mut BytesMut) -> Settled {
        let mut st = self.lock();
        let st = &mut *st;
        if st.error.is_none() && !st.failed {
            loop {
                match st.decode.step(buf, &mut st.extensions).map_err(malformed) {
                    Ok(Step::Frame(_)) => {}
                    Ok(Step::End) => {
                        st.decode = Decoder::Done;
                        break;
                    }
                    Ok(Step::More) => break,
                    Err(e) => {
                        st.error = Some(e);
                        break;
                    }
                }
            }
        }
        let settled = match st.settled() {
            Some(Settled::Done) => Settled::Done,
            Some(Settled::Failed) => Settled::Failed,
            _ => Settled::Dropped,
        };
        // Whoever still holds the body gets no more of it.
        if settled != Settled::Done && st.error.is_none() && !st.failed {
            st.error = Some(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "the answer ended before the request body was read",
            ));
        }
        st.gone = true;
        if let Some(w) = st.body.take() {
            w.wake();
        }
        settled
    }
}

impl State {
    fn settled(&self) -> Option<Settled> {
        if self.failed || self.error.is_some() {
            Some(Settled::Failed)
        } else if matches!(self.decode, Decoder::Done) {
            Some(Settled::Done)
        } else if self.gone {
            Some(Settled::Dropped)
        } else {
            None
        }
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|e| e.into_inner())
}

/// Read into `buf`'s spare room (made first): how many bytes came.
pub(crate) fn poll_read_buf<IO: AsyncRead + Unpin>(
    io: &mut IO,
    cx: &mut Context<'_>,
    buf: &mut BytesMut,
) -> Poll<std::io::Result<usize>> {
    if buf.capacity() - buf.len() < 1024 {
        buf.reserve(READ_SIZE);
    }
    let filled = {
        let mut rb = ReadBuf::uninit(buf.spare_capacity_mut());
        match Pin::new(&mut *io).poll_read(cx, &mut rb) {
            Poll::Ready(Ok(())) => rb.filled().len(),
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending => return Poll::Pending,
        }
    };
    // SAFETY: `poll_read` initialised the first `filled` bytes of the spare room.
    unsafe { buf.set_len(buf.len() + filled) };
    Poll::Ready(Ok(filled))
}

/// The body the request path reads.
pub struct RequestBody {
    state: Arc<Mutex<State>>,
    hint: SizeHint,
    /// A frame has been asked for.
    started: bool,
}

impl http_body::Body for RequestBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.started = true;
        let mut st = lock(&self.state);
        if let Some(f) = st.ready.take() {
            return Poll::Ready(Some(Ok(f)));
        }
        if let Some(e) = st.error.take() {
            st.failed = true;
            return Poll::Ready(Some(Err(e.into())));
        }
        if st.failed || matches!(st.decode, Decoder::Done) {
            return Poll::Ready(None);
        }
        st.want = true;
        st.body = Some(cx.waker().clone());
        if let Some(w) = st.conn.take() {
            w.wake();
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        let st = lock(&self.state);
        st.ready.is_none() && st.error.is_none() && matches!(st.decode, Decoder::Done)
    }

    fn size_hint(&self) -> SizeHint {
        if !self.started {
            return self.hint;
        }
        match lock(&self.state).decode {
            Decoder::Length(n) => SizeHint::with_exact(n),
            Decoder::Done => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

impl Drop for RequestBody {
    fn drop(&mut self) {
        let mut st = lock(&self.state);
        st.gone = true;
        st.want = false;
        if let Some(w) = st.conn.take() {
            w.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every frame of `wire` decoded at once, and what is left.
    fn decode_all(
        mut d: Decoder,
        wire: &str,
    ) -> Result<(Vec<String>, String), crate::http::h1::framing::FramingError> {
        let mut buf = BytesMut::from(wire.as_bytes());
        let mut ext = 0;
        let mut out = Vec::new();
        loop {
            match d.step(&mut buf, &mut ext)? {
                Step::Frame(f) => match f.into_data() {
                    Ok(d) => out.push(String::from_utf8_lossy(&d).into_owned()),
                    Err(f) => out.push(format!("{:?}", f.into_trailers().ok())),
                },
                Step::End | Step::More => break,
            }
            if matches!(d, Decoder::Done) {
                break;
            }
        }
        Ok((out, String::from_utf8_lossy(&buf).into_owned()))
    }

    #[test]
    fn lengths_and_chunks_are_decoded_to_their_end() {
        let (frames, rest) = decode_all(Decoder::Length(5), "helloGET").unwrap();
        assert_eq!((frames, rest.as_str()), (vec!["hello".to_owned()], "GET"));
        let (frames, rest) = decode_all(
            Decoder::chunked(),
            "5;ext=1\r\nhello\r\n1\r\n!\r\n0\r\nx-sum: 8\r\n\r\nGET",
        )
        .unwrap();
        assert_eq!(frames[..2], ["hello".to_owned(), "!".to_owned()]);
        assert!(frames[2].contains("x-sum"), "{frames:?}");
        assert_eq!(rest, "GET");
        let (frames, rest) = decode_all(Decoder::chunked(), "0\r\n\r\nGET").unwrap();
        assert!(frames.is_empty());
        assert_eq!(rest, "GET");
        for bad in ["x\r\n", "5\r\nhelloXX", "1\nA\r\n", "-1\r\n"] {
            assert!(decode_all(Decoder::chunked(), bad).is_err(), "{bad:?}");
        }
    }
}
