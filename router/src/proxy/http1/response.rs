//! A response body read off its connection, de-chunked, and the connection's way back to
//! its pool.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes, BytesMut};
use http::Response;
use http_body::{Body, Frame, SizeHint};

use super::head::{Framing, Head, MAX_HEAD_BYTES, MAX_HEADERS};
use super::{Conn, READ_BUFFER};
use crate::proxy::body::BoxError;
use crate::proxy::pool::Checkin;

/// Where a response body is in its framing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// This many bytes of the body left.
    Length(u64),
    /// A chunk-size line is next.
    ChunkSize,
    /// This many bytes of the current chunk left.
    Chunk(u64),
    /// The CRLF after a chunk's data.
    ChunkEnd,
    /// Trailer fields up to an empty line.
    Trailers,
    UntilClose,
    Done,
}

/// A response body read off its connection. When it ends where its framing says, the
/// connection goes back to its pool ([`Checkin`]) if the replica keeps it open; dropped
/// earlier, the connection is closed.
pub struct UpstreamBody {
    conn: Option<Conn>,
    state: State,
    keep_alive: bool,
    checkin: Option<Checkin>,
}

/// The response body ended before its framing said it would.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("the replica closed the connection before the response ended")]
    Truncated,
    #[error("reading the response body: {0}")]
    Io(#[from] std::io::Error),
    #[error("malformed chunked body: {0}")]
    Chunked(&'static str),
}

impl UpstreamBody {
    /// The body that follows `head` on `conn`. An empty one checks the connection in at once.
    pub fn new(conn: Conn, head: &Head, checkin: Checkin) -> Self {
        let state = match head.framing {
            Framing::Length(0) => State::Done,
            Framing::Length(n) => State::Length(n),
            Framing::Chunked => State::ChunkSize,
            Framing::UntilClose => State::UntilClose,
        };
        let keep_alive = head.keep_alive && !conn.cut_short;
        let mut body = Self { conn: Some(conn), state, keep_alive, checkin: Some(checkin) };
        if body.state == State::Done {
            body.finish();
        }
        body
    }

    /// The body ended where its framing said: the connection may carry another request,
    /// unless the replica sent more than the response.
    fn finish(&mut self) {
        self.state = State::Done;
        if let (Some(conn), Some(checkin), true) = (self.conn.take(), self.checkin.take(), self.keep_alive)
            && conn.buf.is_empty()
        {
            checkin.checkin(conn);
        }
    }

    /// Reads more from the socket; `Ok(0)` at its end.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<Result<usize, BodyError>> {
        let Some(conn) = self.conn.as_mut() else { return Poll::Ready(Ok(0)) };
        if conn.buf.capacity() - conn.buf.len() < 1024 {
            conn.buf.reserve(READ_BUFFER);
        }
        let n = ready!(tokio_util::io::poll_read_buf(Pin::new(&mut conn.stream), cx, &mut conn.buf))?;
        if n > 0 {
            conn.last_read = Some(tokio::time::Instant::now());
        }
        Poll::Ready(Ok(n))
    }

    fn buf(&mut self) -> &mut BytesMut {
        &mut self.conn.as_mut().expect("a body being read has its connection").buf
    }

    /// Up to `left` bytes of data already read, if any.
    fn take(&mut self, left: u64) -> Bytes {
        let buf = self.buf();
        let n = (buf.len() as u64).min(left) as usize;
        buf.split_to(n).freeze()
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        loop {
            let (buffered, first) =
                this.conn.as_ref().map_or((0, None), |c| (c.buf.len(), c.buf.first().copied()));
            match this.state {
                State::Done => return Poll::Ready(None),
                State::Length(left) if buffered > 0 => {
                    let data = this.take(left);
                    match left - data.len() as u64 {
                        0 => this.finish(),
                        left => this.state = State::Length(left),
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                State::Chunk(left) if buffered > 0 => {
                    let data = this.take(left);
                    this.state = match left - data.len() as u64 {
                        0 => State::ChunkEnd,
                        left => State::Chunk(left),
                    };
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                State::UntilClose if buffered > 0 => {
                    let data = this.take(u64::MAX);
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                // httparse reads a size line without digits as 0: that would end the body.
                State::ChunkSize if first.is_some_and(|b| !b.is_ascii_hexdigit()) => {
                    return Poll::Ready(Some(Err(BodyError::Chunked("bad chunk size line").into())));
                }
                // Leading zeros are digits too (`1*HEXDIG`, RFC 9112 §7.1), where httparse
                // reads 16 digits at most: all but the last before another digit go.
                State::ChunkSize if this.conn.as_ref().is_some_and(|c| c.buf.starts_with(b"00")) => {
                    let zeros = this.buf().iter().take_while(|&&b| b == b'0').count();
                    let keep = usize::from(this.buf().get(zeros).is_none_or(|b| !b.is_ascii_hexdigit()));
                    this.buf().advance(zeros - keep);
                    continue;
                }
                State::ChunkSize if buffered > 0 => match httparse::parse_chunk_size(this.buf()) {
                    Ok(httparse::Status::Complete((used, size))) => {
                        this.buf().advance(used);
                        this.state = if size == 0 { State::Trailers } else { State::Chunk(size) };
                        continue;
                    }
                    Ok(httparse::Status::Partial) if buffered < 1024 => {}
                    _ => return Poll::Ready(Some(Err(BodyError::Chunked("bad chunk size line").into()))),
                },
                State::ChunkEnd if buffered >= 2 => {
                    if !this.buf().starts_with(b"\r\n") {
                        return Poll::Ready(Some(Err(BodyError::Chunked("no CRLF after a chunk").into())));
                    }
                    this.buf().advance(2);
                    this.state = State::ChunkSize;
                    continue;
                }
                State::Trailers if buffered > 0 => {
                    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
                    match httparse::parse_headers(this.buf(), &mut fields) {
                        Ok(httparse::Status::Complete((used, _))) => {
                            this.buf().advance(used);
                            this.finish();
                            return Poll::Ready(None);
                        }
                        Ok(httparse::Status::Partial) if buffered < MAX_HEAD_BYTES => {}
                        _ => return Poll::Ready(Some(Err(BodyError::Chunked("bad trailer section").into()))),
                    }
                }
                _ => {}
            }
            match ready!(this.poll_fill(cx)) {
                Ok(0) if this.state == State::UntilClose => {
                    this.state = State::Done;
                    this.conn = None;
                    return Poll::Ready(None);
                }
                Ok(0) => return Poll::Ready(Some(Err(BodyError::Truncated.into()))),
                Ok(_) => {}
                Err(e) => return Poll::Ready(Some(Err(e.into()))),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.state == State::Done
    }

    fn size_hint(&self) -> SizeHint {
        match self.state {
            State::Length(n) => SizeHint::with_exact(n),
            State::Done => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

/// A response whose body reads off `conn`.
pub fn response(conn: Conn, head: Head, checkin: Checkin) -> Response<UpstreamBody> {
    let body = UpstreamBody::new(conn, &head, checkin);
    Response::from_parts(head.parts, body)
}
