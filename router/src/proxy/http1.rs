//! HTTP/1.1 on an upstream connection, as the proxy needs it: a request goes out as one
//! vectored write (head and body), the response head is read with `httparse`, and the body
//! is delimited by its framing (RFC 9112 §6.3) and passed on as it arrives, each read of the
//! socket one frame, de-chunked, without copying.
//!
//! Why not hyper's client connection: it runs each connection as a task of its own and hands
//! requests, responses and body chunks to it over channels, several task wake-ups a request.
//! Here the request's own task writes and reads the socket. Measured on the router in front
//! of nginx (user-space CPU a proxied request, three paired runs): 8.3-9.9 µs with hyper's
//! client, 6.6-7.8 µs with this. The client side stays hyper's server: clients are anyone,
//! replicas are HTTP/1.1 servers the router was configured with.
//!
//! What is supported on the way back: `Content-Length`, `Transfer-Encoding: chunked` (chunk
//! extensions and trailers are read and dropped; any other transfer coding is refused),
//! bodies delimited by the connection's close, no body for `HEAD`, 204 and 304, interim 1xx
//! responses skipped. A connection goes back to its pool only when its response ended
//! exactly where its framing said and the replica did not ask to close it. A replica that
//! answers before it has read the whole request (a 413 or 404 to a long upload) is heard:
//! long and streamed bodies are written while the socket is watched for its answer.
//!
//! Layout: here the connection and the request on its way out; [`head`] the response head
//! and its framing; [`response`] the response body and the connection's way back to its pool.

use bytes::{Buf, Bytes, BytesMut};
use http::Method;
use http::header::{self, HeaderMap};
use http_body::Body;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::Instant;
use tokio_util::either::Either;

use super::body::{BoxError, ProxyBody};
use super::connect::{self, Stream};

mod head;
mod response;

pub use head::{Framing, Head, MAX_HEAD_BYTES, connection_options, parse_head, parse_upgrade_head};
pub use response::{BodyError, UpstreamBody, response};

/// Read buffer of a connection; grows for larger heads.
const READ_BUFFER: usize = 16 * 1024;
/// Request bodies in hand up to this size are written without watching for an early answer
/// (they fit the socket's buffers).
const WATCH_BEYOND: usize = 16 * 1024;

/// [`parse_head`] or [`parse_upgrade_head`].
type ParseHead = fn(&[u8], &Method) -> Result<Option<(usize, Head)>, WireError>;

/// Why an exchange on a connection failed.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("writing the request: {0}")]
    Write(#[source] std::io::Error),
    /// Before any byte of the response.
    #[error("reading the response: {0}")]
    Read(#[source] std::io::Error),
    #[error("the replica closed the connection before answering")]
    ClosedBeforeAnswer,
    #[error("the replica's response head is malformed: {0}")]
    Malformed(String),
    #[error("reading the request body: {0}")]
    RequestBody(#[source] BoxError),
}

impl WireError {
    /// Whether a request that failed so on a reused connection goes out once more, on a new
    /// connection to the same replica: when nothing of a response came back (the write
    /// failed, or the replica closed or reset the connection, typically an idle one it closed
    /// as the request went out). This holds for a POST too. The forwarder would otherwise send
    /// it to the next replica, which is no safer if the replica did run it, and would count
    /// the race as the replica's failure and lose its cached prefix.
    pub fn may_resend(&self) -> bool {
        match self {
            WireError::Write(_) | WireError::Read(_) | WireError::ClosedBeforeAnswer => true,
            WireError::Malformed(_) | WireError::RequestBody(_) => false,
        }
    }
}

/// An open connection to a replica and the bytes read from it but not yet used.
pub struct Conn {
    stream: Stream,
    buf: BytesMut,
    /// The replica answered before the whole request went out: the connection is not
    /// reused.
    cut_short: bool,
    /// An interim answer other than `100 Continue` came while the request went out: the
    /// replica has it under way ([`Self::read_head_with`]).
    under_way: bool,
    /// When the replica's last bytes were read: its server's keep-alive timer started no
    /// later (the pool counts a connection's idle time from here, not from when a slow
    /// client let the response end).
    pub(super) last_read: Option<Instant>,
    /// Over TLS, the [`connect::ReplicaTls::generation`] it was made with: one made with
    /// settings changed since is not reused.
    pub(super) tls_generation: u64,
}

/// A request's body on its way out.
pub enum Outgoing {
    /// In hand: sent with `Content-Length`, and can be sent again.
    Full(Bytes),
    /// Streamed: sent with `Content-Length` if the body knows its length, else chunked.
    Stream(ProxyBody),
}

impl Outgoing {
    /// A streamed body known to be empty as one in hand (which can go on a pooled connection
    /// and be sent again).
    pub fn in_hand_if_empty(self) -> Self {
        match self {
            Outgoing::Stream(stream) if stream.size_hint().exact() == Some(0) => Outgoing::Full(Bytes::new()),
            body => body,
        }
    }
}

impl Conn {
    pub fn new(stream: Stream) -> Self {
        Self {
            stream,
            buf: BytesMut::with_capacity(READ_BUFFER),
            cut_short: false,
            under_way: false,
            last_read: None,
            tls_generation: 0,
        }
    }

    /// Whether an idle connection can carry a request: the replica has not closed it and
    /// sent nothing unasked. Costs a system call only when the socket was seen readable. Over
    /// TLS, neither may what was read off the socket already (and decrypted, or not yet), nor
    /// what is on the socket under it: any record (a `close_notify` too) makes it unusable.
    pub fn is_usable(&mut self) -> bool {
        if let Either::Right(tls) = &mut self.stream {
            let pending = tls.get_mut().1.process_new_packets();
            if !pending.is_ok_and(|state| state.plaintext_bytes_to_read() == 0 && !state.peer_has_closed()) {
                return false;
            }
        }
        match connect::tcp(&self.stream).try_read(&mut [0u8; 1]) {
            Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
            Ok(_) => false,
        }
    }

    /// Sends a request ([`Self::write_request`]) and reads the head of its answer. If the
    /// write fails because the replica answered and closed before reading the whole request,
    /// that answer is what comes back.
    pub async fn exchange(
        &mut self,
        method: &Method,
        target: &str,
        host: &str,
        headers: &HeaderMap,
        body: Outgoing,
    ) -> Result<Head, WireError> {
        let head = request_head(method, target, host, headers);
        match self.write_request(method, head, body).await {
            // Closed before the request went out whole: the replica cannot have run it.
            Ok(()) if self.cut_short => match self.read_head(method).await {
                Err(e @ (WireError::ClosedBeforeAnswer | WireError::Read(_))) => {
                    Err(WireError::Write(std::io::Error::new(
                        std::io::ErrorKind::BrokenPipe,
                        format!("before the whole request: {e}"),
                    )))
                }
                answered => answered,
            },
            Ok(()) => self.read_head(method).await,
            Err(WireError::Write(e)) => {
                self.cut_short = true;
                self.read_head(method).await.map_err(|_| WireError::Write(e))
            }
            Err(e) => Err(e),
        }
    }

    /// Sends a request without a body that asks to switch protocols (`headers` carry its
    /// `Upgrade` and `Connection: upgrade`) and reads the head of its answer: a `101`, after
    /// which the connection is the new protocol's ([`Self::into_upgraded`]), or an ordinary
    /// response.
    pub async fn exchange_upgrade(
        &mut self,
        method: &Method,
        target: &str,
        host: &str,
        headers: &HeaderMap,
    ) -> Result<Head, WireError> {
        let mut head = request_head(method, target, host, headers);
        head.extend_from_slice(b"\r\n");
        self.stream.write_all(&head).await.map_err(WireError::Write)?;
        self.stream.flush().await.map_err(WireError::Write)?;
        self.read_head_with(method, parse_upgrade_head).await
    }

    /// The connection after a `101`: its socket, and what the replica sent after the head
    /// (the new protocol's first bytes).
    pub fn into_upgraded(self) -> (Stream, BytesMut) {
        (self.stream, self.buf)
    }

    /// Writes a request: its `head` (the fields of [`request_head`]), then the body.
    async fn write_request(
        &mut self,
        method: &Method,
        head: Vec<u8>,
        body: Outgoing,
    ) -> Result<(), WireError> {
        self.under_way = false;
        let body = body.in_hand_if_empty();
        if let Outgoing::Full(bytes) = &body
            && bytes.len() <= WATCH_BEYOND
        {
            return write_body(&mut self.stream, method, head, body).await;
        }
        // A longer body may not fit the socket's buffers: if the replica answers (or closes)
        // without reading it all, writing would wait for ever or fail, so the answer is
        // watched for meanwhile and, if it comes first, read without sending the rest.
        let Conn { stream, buf, cut_short, under_way, .. } = self;
        let watching = (buf, under_way);
        let answered = match stream {
            Either::Left(tcp) => {
                let (reader, writer) = tcp.split();
                write_watching(reader, writer, method, head, body, watching).await?
            }
            Either::Right(tls) => {
                let (reader, writer) = tokio::io::split(tls);
                write_watching(reader, writer, method, head, body, watching).await?
            }
        };
        *cut_short |= answered;
        Ok(())
    }

    /// Reads the final response head to a request with `method`, skipping interim ones.
    async fn read_head(&mut self, method: &Method) -> Result<Head, WireError> {
        self.read_head_with(method, parse_head).await
    }

    /// [`Self::read_head`] with `parse`: a `101` it accepts is final.
    async fn read_head_with(&mut self, method: &Method, parse: ParseHead) -> Result<Head, WireError> {
        // An interim answer other than `100 Continue` came: the request is under way.
        let mut under_way = std::mem::take(&mut self.under_way);
        let mut read_any = !self.buf.is_empty() || under_way;
        loop {
            if !self.buf.is_empty() {
                match parse(&self.buf, method)? {
                    Some((length, head)) => {
                        self.buf.advance(length);
                        let status = head.parts.status;
                        if status.is_informational() && status != http::StatusCode::SWITCHING_PROTOCOLS {
                            // Only bytes of the final head make a close there malformed: a
                            // replica that answered `100 Continue` and closed answered nothing.
                            // Another interim answer (`103 Early Hints`) says the request is
                            // under way: it may have run, so it must not go out again.
                            under_way |= status != http::StatusCode::CONTINUE;
                            read_any = !self.buf.is_empty() || under_way;
                            continue;
                        }
                        self.last_read = Some(Instant::now());
                        return Ok(head);
                    }
                    None if self.buf.len() >= MAX_HEAD_BYTES => {
                        return Err(WireError::Malformed(format!("head longer than {MAX_HEAD_BYTES} bytes")));
                    }
                    None => {}
                }
            }
            self.buf.reserve(READ_BUFFER);
            match self.stream.read_buf(&mut self.buf).await {
                Ok(0) if read_any => {
                    return Err(WireError::Malformed("the connection closed inside the head".into()));
                }
                Ok(0) => return Err(WireError::ClosedBeforeAnswer),
                Ok(_) => read_any = true,
                Err(e) if read_any => {
                    return Err(WireError::Malformed(format!("the connection failed inside the head: {e}")));
                }
                Err(e) => return Err(WireError::Read(e)),
            }
        }
    }
}

/// A request's head without its framing fields or the blank line: `method target`,
/// `Host: host`, `headers` (hop-by-hop ones already removed; `Content-Length`,
/// `Transfer-Encoding` and `Expect` are set when the body is written). Header values cannot
/// hold CR or LF (`HeaderValue` refuses them), so nothing here can end the head early.
fn request_head(method: &Method, target: &str, host: &str, headers: &HeaderMap) -> Vec<u8> {
    let mut head = Vec::with_capacity(512);
    head.extend_from_slice(method.as_str().as_bytes());
    head.push(b' ');
    head.extend_from_slice(target.as_bytes());
    head.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    head.extend_from_slice(host.as_bytes());
    head.extend_from_slice(b"\r\n");
    let mut cookies = false;
    for (name, value) in headers {
        if name == header::CONTENT_LENGTH || name == header::TRANSFER_ENCODING || name == header::EXPECT {
            continue;
        }
        // HTTP/2 clients send each cookie as a field of its own; HTTP/1.1 takes them as one,
        // joined by "; " (RFC 9113 §8.2.3): many servers read only the first `Cookie` line.
        if name == header::COOKIE {
            if std::mem::replace(&mut cookies, true) {
                continue;
            }
            head.extend_from_slice(b"cookie: ");
            for (i, cookie) in headers.get_all(header::COOKIE).iter().enumerate() {
                if i > 0 {
                    head.extend_from_slice(b"; ");
                }
                head.extend_from_slice(cookie.as_bytes());
            }
            head.extend_from_slice(b"\r\n");
            continue;
        }
        head.extend_from_slice(name.as_str().as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(value.as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    head
}

/// Writes the request `head` and `body` to `writer` while `reader` is read into `buf`: true if
/// the replica answered (or closed) before the request went out whole. An interim answer
/// (100, 103) is read and dropped, and the body goes on (`under_way` set for one other than
/// 100).
async fn write_watching<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    mut reader: R,
    mut writer: W,
    method: &Method,
    head: Vec<u8>,
    body: Outgoing,
    (buf, under_way): (&mut BytesMut, &mut bool),
) -> Result<bool, WireError> {
    let write = write_body(&mut writer, method, head, body);
    tokio::pin!(write);
    loop {
        buf.reserve(READ_BUFFER);
        tokio::select! {
            biased;
            read = reader.read_buf(buf) => {
                if matches!(read, Ok(n) if n > 0) && only_interim(buf, method, under_way)? {
                    continue;
                }
                return Ok(true);
            }
            written = &mut write => return written.map(|()| false),
        }
    }
}

/// Whether what the replica sent while the request was going out (read into `buf`) was only
/// interim answers (or the start of one), dropped from `buf`, so the request can go on. Sets
/// `under_way` if one of them was other than `100 Continue`.
fn only_interim(buf: &mut BytesMut, method: &Method, under_way: &mut bool) -> Result<bool, WireError> {
    while !buf.is_empty() {
        match parse_head(buf, method)? {
            Some((length, head)) if head.parts.status.is_informational() => {
                *under_way |= head.parts.status != http::StatusCode::CONTINUE;
                buf.advance(length);
            }
            Some(_) => return Ok(false),
            None if buf.len() >= MAX_HEAD_BYTES => {
                return Err(WireError::Malformed(format!("head longer than {MAX_HEAD_BYTES} bytes")));
            }
            None => return Ok(true),
        }
    }
    Ok(true)
}

/// Writes the request `head` (its fields, without the blank line) and `body` to `out`.
async fn write_body<W: AsyncWrite + Unpin>(
    out: &mut W,
    method: &Method,
    mut head: Vec<u8>,
    body: Outgoing,
) -> Result<(), WireError> {
    use http_body_util::BodyExt;
    let mut body = match body {
        Outgoing::Full(body) => {
            if !body.is_empty() || method_has_body(method) {
                head.extend_from_slice(b"content-length: ");
                head.extend_from_slice(itoa::Buffer::new().format(body.len()).as_bytes());
                head.extend_from_slice(b"\r\n");
            }
            head.extend_from_slice(b"\r\n");
            let mut all = Bytes::from(head).chain(body);
            out.write_all_buf(&mut all).await.map_err(WireError::Write)?;
            return out.flush().await.map_err(WireError::Write);
        }
        Outgoing::Stream(body) => body,
    };
    let length = body.size_hint().exact();
    match length {
        Some(n) => head.extend_from_slice(format!("content-length: {n}\r\n\r\n").as_bytes()),
        None => head.extend_from_slice(b"transfer-encoding: chunked\r\n\r\n"),
    }
    out.write_all(&head).await.map_err(WireError::Write)?;
    let mut sent = 0;
    // A body of known length is done once that much went out; it need not say it ended.
    while length != Some(sent)
        && let Some(frame) = body.frame().await
    {
        let frame = frame.map_err(WireError::RequestBody)?;
        let Ok(data) = frame.into_data() else { continue };
        if data.is_empty() {
            continue;
        }
        sent += data.len() as u64;
        if length.is_some_and(|n| sent > n) {
            return Err(WireError::RequestBody("the request body is longer than its length".into()));
        }
        if length.is_some() {
            let mut data = data;
            out.write_all_buf(&mut data).await.map_err(WireError::Write)?;
        } else {
            let size = Bytes::from(format!("{:x}\r\n", data.len()));
            let mut chunk = size.chain(data).chain(Bytes::from_static(b"\r\n"));
            out.write_all_buf(&mut chunk).await.map_err(WireError::Write)?;
        }
        // Over TLS, each piece goes out as it comes, not when the next one does.
        out.flush().await.map_err(WireError::Write)?;
    }
    if length.is_none() {
        out.write_all(b"0\r\n\r\n").await.map_err(WireError::Write)?;
    }
    out.flush().await.map_err(WireError::Write)
}

fn method_has_body(method: &Method) -> bool {
    !matches!(*method, Method::GET | Method::HEAD | Method::DELETE | Method::OPTIONS | Method::TRACE)
}

#[cfg(test)]
mod tests;
