//! A message body decoded from the front of a buffer, for both codecs: the server's
//! request bodies (`request_body`) and the client's response bodies (`client`). One
//! state machine for `Content-Length`, chunked (RFC 9112 §7.1) and close-delimited
//! bodies, with one set of limits (`framing`'s, and the chunk extensions' below).

use std::io;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http_body::{Frame, SizeHint};

use super::framing::{self, FramingError};

/// hyper's limit on the chunk extensions of one body, in bytes.
pub(crate) const EXTENSIONS_LIMIT: u64 = 16 * 1024;

/// Where a body is.
#[derive(Debug)]
pub enum Decoder {
    /// This many bytes to go.
    Length(u64),
    Chunked(Chunk),
    /// Until the connection closes (a response without a length).
    Eof,
    Done,
}

/// Where a chunked body is.
#[derive(Debug)]
pub enum Chunk {
    Size,
    Data(u64),
    /// The CRLF after a chunk's data.
    DataEnd,
    /// After the last chunk: trailer fields, then an empty line.
    Trailers,
}

/// What `Decoder::step` found in the buffer.
pub(crate) enum Step {
    Frame(Frame<Bytes>),
    /// The body is over (no trailers).
    End,
    /// More bytes are needed (for `Eof`: or the end of the stream).
    More,
}

/// Where a body is read from: what has been read and not yet used, and more of it.
/// A client connection (`client::Conn`), bytes in memory for the fuzz targets.
pub(crate) trait Source {
    /// What has been read and not yet used, and the chunk extension bytes of the
    /// body being read so far (`EXTENSIONS_LIMIT`).
    fn unread(&mut self) -> (&mut BytesMut, &mut u64);
    /// Reads more into the buffer: `Ok(0)` is the end of the stream.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>>;
}

/// How reading a body from a `Source` failed.
#[derive(Debug)]
pub(crate) enum DecodeError {
    Framing(FramingError),
    /// The stream ended first.
    Incomplete,
    Io(io::Error),
}

impl Decoder {
    pub fn chunked() -> Decoder {
        Decoder::Chunked(Chunk::Size)
    }

    pub fn is_end(&self) -> bool {
        matches!(self, Decoder::Done | Decoder::Length(0))
    }

    pub fn size_hint(&self) -> SizeHint {
        match self {
            Decoder::Length(n) => SizeHint::with_exact(*n),
            Decoder::Done => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }

    /// The next frame at the front of `buf`, taken out; `extensions` counts the
    /// body's chunk extension bytes.
    pub(crate) fn step(
        &mut self,
        buf: &mut BytesMut,
        extensions: &mut u64,
    ) -> Result<Step, FramingError> {
        loop {
            match self {
                Decoder::Done | Decoder::Length(0) => {
                    *self = Decoder::Done;
                    return Ok(Step::End);
                }
                Decoder::Length(left) | Decoder::Chunked(Chunk::Data(left)) => {
                    if buf.is_empty() {
                        return Ok(Step::More);
                    }
                    let n = usize::try_from(*left).unwrap_or(usize::MAX).min(buf.len());
                    *left -= n as u64;
                    let data = buf.split_to(n).freeze();
                    match self {
                        Decoder::Chunked(c @ Chunk::Data(0)) => *c = Chunk::DataEnd,
                        Decoder::Length(0) => *self = Decoder::Done,
                        _ => {}
                    }
                    return Ok(Step::Frame(Frame::data(data)));
                }
                Decoder::Eof => {
                    if buf.is_empty() {
                        return Ok(Step::More);
                    }
                    return Ok(Step::Frame(Frame::data(buf.split().freeze())));
                }
                Decoder::Chunked(chunk) => {
                    let next = match chunk {
                        Chunk::Size => match chunk_size(buf, extensions)? {
                            None => return Ok(Step::More),
                            Some(next) => next,
                        },
                        Chunk::DataEnd => match buf.get(..2) {
                            None if b"\r\n".starts_with(&buf[..]) => return Ok(Step::More),
                            Some(b"\r\n") => {
                                buf.advance(2);
                                Chunk::Size
                            }
                            _ => return Err(FramingError::Malformed("chunk not followed by CRLF")),
                        },
                        Chunk::Trailers => {
                            return match framing::trailers(buf)? {
                                None => Ok(Step::More),
                                Some(t) => {
                                    *self = Decoder::Done;
                                    Ok(t.map_or(Step::End, |t| Step::Frame(Frame::trailers(t))))
                                }
                            };
                        }
                        Chunk::Data(_) => unreachable!("handled above"),
                    };
                    *chunk = next;
                }
            }
        }
    }

    /// The next frame of the body from `src`, read from it as needed.
    pub(crate) fn poll_from<S: Source>(
        &mut self,
        src: &mut S,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, DecodeError>>> {
        loop {
            let (buf, extensions) = src.unread();
            match self.step(buf, extensions) {
                Err(e) => return Poll::Ready(Some(Err(DecodeError::Framing(e)))),
                Ok(Step::Frame(f)) => return Poll::Ready(Some(Ok(f))),
                Ok(Step::End) => return Poll::Ready(None),
                Ok(Step::More) => match ready!(src.poll_fill(cx)) {
                    Ok(0) if matches!(self, Decoder::Eof) => {
                        *self = Decoder::Done;
                        return Poll::Ready(None);
                    }
                    Ok(0) => return Poll::Ready(Some(Err(DecodeError::Incomplete))),
                    Ok(_) => {}
                    Err(e) => return Poll::Ready(Some(Err(DecodeError::Io(e)))),
                },
            }
        }
    }
}

/// A chunk-size line (`hex[;extensions]CRLF`) at the front of `buf`, taken out:
/// the state after it, or `None` until the whole line is there.
pub(crate) fn chunk_size(
    buf: &mut BytesMut,
    extensions: &mut u64,
) -> Result<Option<Chunk>, FramingError> {
    let Some((taken, size)) = framing::size_line(buf)? else {
        return Ok(None);
    };
    if let Some(at) = buf[..taken].iter().position(|&b| b == b';') {
        *extensions += (taken - at) as u64;
        if *extensions >= EXTENSIONS_LIMIT {
            return Err(FramingError::Malformed("chunk extensions over limit"));
        }
    }
    buf.advance(taken);
    Ok(Some(if size == 0 {
        Chunk::Trailers
    } else {
        Chunk::Data(size)
    }))
}
