//! The proxy's upstream connections: one pool per HTTP thread of HTTP/1.1 connections to the
//! replicas ([`super::http1`]), keyed by replica address.
//!
//! Why not hyper-util's pooled client, which the health checks and remote tokenization use:
//! per request it races a pool checkout against a lazily built connect future, and when the
//! response body is still to come (for a proxy, always) it spawns a task that returns the
//! connection once it is idle; and hyper's client connection runs as a task of its own,
//! reached over channels. Here the request's task writes the request and reads the response
//! itself, and a connection goes back to its pool when its response body has been read to
//! the end ([`Checkin`], called by [`UpstreamBody`]), so nothing is spawned or raced per
//! request.
//!
//! A connection whose response did not end cleanly (client gone, upstream error, idle
//! timeout) is closed, not pooled: its state is unknown. A pooled connection the replica has
//! closed meanwhile is found out at checkout ([`Conn::is_usable`]); expired ones are closed
//! every second ([`sweep_while_held`]), whether or not the thread is busy. Idle connections are kept
//! for less time than the replicas' servers keep them (uvicorn, under vLLM and SGLang: 5 s),
//! counted from the response's last byte read off the socket (where the server's keep-alive
//! timer starts too), not from when a slow client let it end, so that the replica closing
//! one just as a request goes out on it is rare; when it happens,
//! the request goes out once more, on a new connection to the same replica
//! ([`WireError::may_resend`]; and after a `408` with `close`, a server's word that it timed
//! the connection out). A request whose body streams takes a new connection: its body
//! could not be sent again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::BytesMut;
use http::uri::Scheme;
use http::{HeaderMap, Method, Request, Response, Uri};
use tokio::time::Instant;

use super::connect::{Origin, ReplicaTls, Stream};
use super::http1::{self, Conn, Outgoing, UpstreamBody, WireError};
use crate::index::hasher::FoldState;

/// Why a request could not be sent.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    #[error("replica URL {0:?} is not an http:// or https:// URL with a host")]
    BadUrl(String),
    #[error("connecting: {0}")]
    Connect(std::io::Error),
    #[error("TLS handshake: {0}")]
    Tls(std::io::Error),
    #[error("TLS handshake: not done within {0:?} of connecting")]
    HandshakeTimeout(Duration),
    #[error("connecting: no connection within {0:?}")]
    ConnectTimeout(Duration),
    #[error(transparent)]
    Wire(#[from] WireError),
    /// A pooled connection failed with the request (the replica may have had it), and no new
    /// one could be made to send it again.
    #[error("{first}; sending again: {then}")]
    Resent { first: WireError, then: Box<SendError> },
}

impl SendError {
    /// Whether nothing of the request reached the replica: no connection to it was made (and
    /// none was tried before on a pooled one).
    pub fn sent_nothing(&self) -> bool {
        matches!(
            self,
            SendError::BadUrl(_)
                | SendError::Connect(_)
                | SendError::Tls(_)
                | SendError::HandshakeTimeout(_)
                | SendError::ConnectTimeout(_)
        )
    }
}

/// A replica's answer to a request that asked to switch protocols.
pub enum Upgrade {
    /// `101 Switching Protocols`: the socket is the new protocol's, and `early` what the
    /// replica already sent of it.
    Switched { head: http::response::Parts, stream: Stream, early: BytesMut },
    /// An ordinary response: the replica stays with HTTP.
    Answered(Response<UpstreamBody>),
}

/// An absolute `http://` or `https://` URI's origin, its target in origin form, and the
/// `Host` it names (the authority without any `user:password@`).
fn destination(uri: &Uri) -> Result<(Origin, &str, &str), SendError> {
    let tls = match uri.scheme() {
        Some(scheme) if *scheme == Scheme::HTTP => false,
        Some(scheme) if *scheme == Scheme::HTTPS => true,
        _ => return Err(SendError::BadUrl(uri.to_string())),
    };
    let Some(authority) = uri.authority() else { return Err(SendError::BadUrl(uri.to_string())) };
    let target = uri.path_and_query().map_or("/", |pq| pq.as_str());
    let host = authority.as_str().rsplit('@').next().unwrap_or_default();
    Ok((Origin { tls, authority: authority.clone() }, target, host))
}

/// Idle connections of one thread.
pub struct Pool {
    idle: Mutex<IdleSet>,
    connect_timeout: Duration,
    tls: ReplicaTls,
    /// Idle connections older than this are closed instead of reused.
    idle_timeout: Duration,
    /// Most idle connections kept per replica.
    max_idle: usize,
}

struct Idle {
    conn: Conn,
    since: Instant,
}

/// How often expired idle connections are closed, whichever replica they lead to.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// Idle connections by replica, and when expired ones were last closed.
struct IdleSet {
    by_replica: HashMap<Origin, Vec<Idle>, FoldState>,
    swept: Instant,
}

impl IdleSet {
    /// Closes the connections idle for `timeout` or more, and forgets replicas left with
    /// none: a replica that gets no more requests (ejected, removed, moved to a new
    /// address) must not keep its connections open (the replica's server closed them long
    /// ago; ours would sit in CLOSE_WAIT).
    fn sweep(&mut self, now: Instant, timeout: Duration) {
        self.swept = now;
        self.by_replica.retain(|_, list| {
            list.retain(|c| now.duration_since(c.since) < timeout);
            !list.is_empty()
        });
    }
}

/// Where a connection goes back to when its response has ended cleanly.
pub struct Checkin {
    pool: Arc<Pool>,
    origin: Origin,
}

impl Checkin {
    /// The response ended cleanly: the connection can carry another request.
    pub fn checkin(self, conn: Conn) {
        let Checkin { pool, origin } = self;
        let mut idle = pool.idle.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if now.duration_since(idle.swept) >= SWEEP_EVERY.min(pool.idle_timeout) {
            idle.sweep(now, pool.idle_timeout);
        }
        let list = idle.by_replica.entry(origin).or_default();
        if list.len() < pool.max_idle {
            // Idle since the replica's last bytes: a response the client took its time over
            // has been idle at the replica's end for that long already.
            let since = conn.last_read.map_or(now, |read| read.min(now));
            list.push(Idle { conn, since });
        }
    }
}

impl Pool {
    pub fn new(connect_timeout: Duration, idle_timeout: Duration, max_idle: usize) -> Self {
        let idle = IdleSet { by_replica: HashMap::with_hasher(FoldState::random()), swept: Instant::now() };
        Self { idle: Mutex::new(idle), connect_timeout, tls: ReplicaTls::default(), idle_timeout, max_idle }
    }

    /// The pool, its connections to `https://` replicas made with `tls`.
    pub fn with_tls(self, tls: ReplicaTls) -> Self {
        Self { tls, ..self }
    }

    /// Sends `request` (its URI absolute: `http://host:port/path`, or `https://`) on a pooled or new
    /// connection; the URI goes out in origin form with `Host` set to its authority.
    pub async fn send(
        self: &Arc<Self>,
        request: Request<Outgoing>,
    ) -> Result<Response<UpstreamBody>, SendError> {
        let (parts, body) = request.into_parts();
        self.send_head(&parts.method, &parts.uri, &parts.headers, body).await
    }

    /// [`Self::send`] of a request given by its parts: the headers are only read, so a
    /// request tried on several replicas prepares them once.
    pub async fn send_head(
        self: &Arc<Self>,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
        body: Outgoing,
    ) -> Result<Response<UpstreamBody>, SendError> {
        self.send_or_give_back(method, uri, headers, body).await.map_err(Unsent::into_error)
    }

    /// [`Self::send_head`], giving the body back whole when no connection to the replica
    /// could be made: it can go to another replica (which after a pooled connection failed,
    /// [`SendError::Resent`], may run it twice).
    pub async fn send_or_give_back(
        self: &Arc<Self>,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
        body: Outgoing,
    ) -> Result<Response<UpstreamBody>, Unsent> {
        let mut body = body.in_hand_if_empty();
        let (origin, target, host) = destination(uri)?;
        let pooled = match &body {
            Outgoing::Full(bytes) => self.checkout(&origin).map(|conn| (conn, bytes.clone())),
            Outgoing::Stream(_) => None,
        };
        // The pooled connection's failure, when the request goes out again on a new one.
        let mut resent_after = None;
        if let Some((mut conn, again)) = pooled {
            match conn.exchange(method, target, host, headers, body).await {
                // A server that times out an idle connection may say so before it closes it
                // (`408` and `close`, as Go's and Apache's do): said as the request went out,
                // it answers no request of the proxy's, which goes out again as after a
                // close (browsers do the same).
                Ok(head) if head.parts.status == http::StatusCode::REQUEST_TIMEOUT && !head.keep_alive => {
                    tracing::debug!(
                        "pooled upstream connection timed out by the replica; sending again on a new one"
                    );
                    body = Outgoing::Full(again);
                }
                Ok(head) => return Ok(http1::response(conn, head, self.checkin(origin))),
                Err(e) if e.may_resend() => {
                    tracing::debug!(error = %e, "pooled upstream connection failed; sending again on a new one");
                    body = Outgoing::Full(again);
                    resent_after = Some(e);
                }
                Err(e) => return Err(Unsent::Failed(e.into())),
            }
        }
        let mut conn = match self.connect(&origin).await {
            Ok(conn) => conn,
            // Not connected again: the replica may have had the request on the pooled one
            // (its process ending as it ran it), which the error says.
            Err(e) => {
                let e = match resent_after {
                    Some(first) => SendError::Resent { first, then: Box::new(e) },
                    None => e,
                };
                return Err(Unsent::NotConnected(e, body));
            }
        };
        let head =
            conn.exchange(method, target, host, headers, body).await.map_err(|e| Unsent::Failed(e.into()))?;
        Ok(http1::response(conn, head, self.checkin(origin)))
    }

    /// Sends a request without a body that asks to switch protocols (its `headers` carry
    /// `Upgrade` and `Connection: upgrade`), on a new connection: the connection is the new
    /// protocol's if the replica agrees, and is never pooled then.
    pub async fn upgrade(
        self: &Arc<Self>,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
    ) -> Result<Upgrade, SendError> {
        let (origin, target, host) = destination(uri)?;
        let mut conn = self.connect(&origin).await?;
        let head = conn.exchange_upgrade(method, target, host, headers).await?;
        if head.parts.status == http::StatusCode::SWITCHING_PROTOCOLS {
            let (stream, early) = conn.into_upgraded();
            return Ok(Upgrade::Switched { head: head.parts, stream, early });
        }
        Ok(Upgrade::Answered(http1::response(conn, head, self.checkin(origin))))
    }

    fn checkin(self: &Arc<Self>, origin: Origin) -> Checkin {
        Checkin { pool: self.clone(), origin }
    }

    /// An idle connection to `origin` the replica has not closed, dropping closed and
    /// expired ones on the way.
    fn checkout(&self, origin: &Origin) -> Option<Conn> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let list = idle.by_replica.get_mut(origin)?;
        let now = Instant::now();
        let generation = if origin.tls { self.tls.generation() } else { 0 };
        while let Some(Idle { mut conn, since }) = list.pop() {
            if now.duration_since(since) < self.idle_timeout
                && conn.tls_generation == generation
                && conn.is_usable()
            {
                return Some(conn);
            }
        }
        None
    }

    async fn connect(&self, origin: &Origin) -> Result<Conn, SendError> {
        // Read first: settings changed during the handshake make the connection stale, not
        // the other way round.
        let generation = if origin.tls { self.tls.generation() } else { 0 };
        let mut conn = Conn::new(self.tls.connect(origin, self.connect_timeout).await?);
        conn.tls_generation = generation;
        Ok(conn)
    }

    /// Closes the expired idle connections (as a check-in does, every [`SWEEP_EVERY`]).
    fn sweep(&self) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        idle.sweep(Instant::now(), self.idle_timeout);
    }

    /// Idle connections held (for tests).
    pub fn idle_count(&self) -> usize {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).by_replica.values().map(Vec::len).sum()
    }
}

/// Closes `pool`'s expired idle connections every [`SWEEP_EVERY`] (at most its idle timeout)
/// until it is dropped: a check-in sweeps too, but a thread that goes quiet checks nothing
/// in, and its connections would stay open, in CLOSE_WAIT once the replicas closed theirs.
pub async fn sweep_while_held(pool: Weak<Pool>) {
    let every = match pool.upgrade() {
        Some(pool) => SWEEP_EVERY.min(pool.idle_timeout).max(Duration::from_millis(1)),
        None => return,
    };
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let Some(pool) = pool.upgrade() else { return };
        pool.sweep();
    }
}

/// Why a request got no answer ([`Pool::send_or_give_back`]).
pub enum Unsent {
    /// No connection to the replica: the body, untouched. (After a pooled connection failed,
    /// [`SendError::Resent`]: the replica may have had the request on that one.)
    NotConnected(SendError, Outgoing),
    Failed(SendError),
}

impl Unsent {
    pub fn into_error(self) -> SendError {
        match self {
            Unsent::NotConnected(e, _) | Unsent::Failed(e) => e,
        }
    }
}

impl From<SendError> for Unsent {
    fn from(e: SendError) -> Self {
        Unsent::Failed(e)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use bytes::Bytes;
    use http::HeaderValue;
    use http::header;
    use http_body_util::BodyExt;
    use hyper::body::Incoming;
    use hyper_util::rt::TokioIo;
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpListener;
    use tokio_util::either::Either;

    use super::*;

    /// An HTTP/1 server on 127.0.0.1 that answers `ok` and counts the connections it
    /// accepted; with `keep_alive` false it closes each connection after one response.
    async fn backend(keep_alive: bool) -> (String, Arc<AtomicUsize>) {
        backend_over(keep_alive, None).await
    }

    /// [`backend`], serving HTTPS with `tls` if given (its URL `https://` then).
    async fn backend_over(
        keep_alive: bool,
        tls: Option<tokio_rustls::TlsAcceptor>,
    ) -> (String, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let scheme = if tls.is_some() { "https" } else { "http" };
        let url = format!("{scheme}://{}", listener.local_addr().unwrap());
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let stream = match &tls {
                    None => Either::Left(stream),
                    Some(tls) => match tls.accept(stream).await {
                        Ok(stream) => Either::Right(stream),
                        Err(_) => continue,
                    },
                };
                let service = hyper::service::service_fn(|req: Request<Incoming>| async move {
                    let host = req.headers().get(header::HOST).cloned();
                    let mut response = Response::new(http_body_util::Full::new(Bytes::from_static(b"ok")));
                    if let Some(host) = host {
                        response.headers_mut().insert("x-seen-host", host);
                    }
                    response
                        .headers_mut()
                        .insert("x-seen-target", HeaderValue::from_str(&req.uri().to_string()).unwrap());
                    Ok::<_, std::convert::Infallible>(response)
                });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .keep_alive(keep_alive)
                        .serve_connection(TokioIo::new(stream), service),
                );
            }
        });
        (url, accepted)
    }

    fn pool() -> Arc<Pool> {
        Arc::new(Pool::new(Duration::from_secs(2), Duration::from_secs(60), 8))
    }

    fn request(url: &str) -> Request<Outgoing> {
        Request::get(format!("{url}/v1/models?x=1")).body(Outgoing::Full(Bytes::new())).unwrap()
    }

    /// Sends one request and reads its whole body if `read`, else drops it unread.
    async fn get(pool: &Arc<Pool>, url: &str, read: bool) -> Response<Bytes> {
        let response = pool.send(request(url)).await.unwrap();
        let (parts, body) = response.into_parts();
        let body = if read { body.collect().await.unwrap().to_bytes() } else { Bytes::new() };
        Response::from_parts(parts, body)
    }

    #[tokio::test]
    async fn connections_whose_response_was_read_carry_the_next_requests() {
        let (url, accepted) = backend(true).await;
        let pool = pool();
        for _ in 0..5 {
            let response = get(&pool, &url, true).await;
            assert_eq!(response.body().as_ref(), b"ok");
            assert_eq!(response.headers()["x-seen-target"], "/v1/models?x=1", "origin form");
            assert_eq!(response.headers()["x-seen-host"], url.trim_start_matches("http://"));
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "one connection for five requests");
        assert_eq!(pool.idle_count(), 1);
    }

    /// A streamed body known to be empty (a passed-through GET's) is sent as one in hand: on
    /// a pooled connection.
    #[tokio::test]
    async fn requests_with_an_empty_streamed_body_use_pooled_connections() {
        let (url, accepted) = backend(true).await;
        let pool = pool();
        for _ in 0..3 {
            let empty = super::super::body::full(Bytes::new());
            let request = Request::get(format!("{url}/v1/models")).body(Outgoing::Stream(empty)).unwrap();
            let response = pool.send(request).await.unwrap();
            assert_eq!(response.into_body().collect().await.unwrap().to_bytes().as_ref(), b"ok");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "one connection for three requests");
    }

    #[tokio::test]
    async fn connections_whose_response_was_not_read_are_not_reused() {
        let (url, accepted) = backend(true).await;
        let pool = pool();
        for _ in 0..3 {
            get(&pool, &url, false).await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
        assert_eq!(pool.idle_count(), 0);
    }

    #[tokio::test]
    async fn a_connection_the_replica_asks_to_close_is_not_reused() {
        let (url, accepted) = backend(false).await;
        let pool = pool();
        for _ in 0..3 {
            // Read to the end each time, but the replica said `connection: close`.
            assert_eq!(get(&pool, &url, true).await.body().as_ref(), b"ok");
            assert_eq!(pool.idle_count(), 0);
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }

    /// Connections to a replica that gets no more requests are closed once expired, when
    /// any other connection of the thread is checked in.
    #[tokio::test]
    async fn expired_connections_to_any_replica_are_closed() {
        let ((a, _), (b, _)) = (backend(true).await, backend(true).await);
        let pool = Arc::new(Pool::new(Duration::from_secs(2), Duration::ZERO, 8));
        get(&pool, &a, true).await;
        assert_eq!(pool.idle_count(), 1);
        get(&pool, &b, true).await;
        let idle = pool.idle.lock().unwrap();
        let left: Vec<_> = idle.by_replica.keys().map(|k| k.to_string()).collect();
        assert_eq!(left, [b], "the first replica's connection closed and the replica forgotten");
    }

    /// A thread that goes quiet checks nothing in: its expired connections are closed all
    /// the same, and the sweeper stops with the pool.
    #[tokio::test]
    async fn a_quiet_pools_expired_connections_are_closed() {
        let (a, _) = backend(true).await;
        let pool = Arc::new(Pool::new(Duration::from_secs(2), Duration::from_millis(50), 8));
        let sweeper = tokio::spawn(sweep_while_held(Arc::downgrade(&pool)));
        get(&pool, &a, true).await;
        assert_eq!(pool.idle_count(), 1);
        // Nothing else happens on the pool: past its idle timeout, the sweeper's tick alone
        // closes the connection.
        tokio::time::pause();
        tokio::time::advance(Duration::from_millis(100)).await;
        for _ in 0..100 {
            if pool.idle_count() == 0 {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert_eq!(pool.idle_count(), 0, "the idle connection was never closed");
        drop(pool);
        tokio::time::timeout(Duration::from_secs(10), sweeper).await.expect("the sweeper stops").unwrap();
    }

    /// A connection is idle at the replica's end from its response's last byte: a client
    /// that takes longer than the idle timeout to take the response leaves it expired.
    #[tokio::test]
    async fn a_connection_counts_as_idle_from_the_replicas_last_byte() {
        let (url, accepted) = backend(true).await;
        let pool = Arc::new(Pool::new(Duration::from_secs(2), Duration::from_millis(300), 8));
        let response = pool.send(request(&url)).await.unwrap();
        // A slow client: the body (in hand with the head) is taken after the idle timeout
        // (the clock moved on by hand; the sockets' waits stay real).
        tokio::time::pause();
        tokio::time::advance(Duration::from_millis(400)).await;
        tokio::time::resume();
        assert_eq!(response.into_body().collect().await.unwrap().to_bytes().as_ref(), b"ok");
        assert_eq!(get(&pool, &url, true).await.body().as_ref(), b"ok");
        assert_eq!(accepted.load(Ordering::SeqCst), 2, "the expired connection was not reused");
        // A client that takes its response at once leaves the connection for the next request.
        assert_eq!(get(&pool, &url, true).await.body().as_ref(), b"ok");
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    /// A replica that times out an idle connection with `408` and `close` as a request goes out
    /// on it: the request goes out again on a new connection (it was not the request's
    /// answer). On a new connection, a 408 is the request's.
    #[tokio::test]
    async fn a_408_closing_a_pooled_connection_sends_the_request_again() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let nth = count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    // Each connection's first request is answered (the third connection's
                    // with a 408 of its own), its second with a 408 and a close.
                    let answers: [&[u8]; 2] = match nth {
                        2 => [
                            b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n",
                            b"",
                        ],
                        _ => [
                            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
                            b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n",
                        ],
                    };
                    let mut buf = Vec::new();
                    for answer in answers.into_iter().filter(|a| !a.is_empty()) {
                        while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                            let mut chunk = [0u8; 1024];
                            match stream.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                        }
                        buf.clear();
                        if stream.write_all(answer).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        let pool = pool();
        assert_eq!(get(&pool, &url, true).await.body().as_ref(), b"ok");
        assert_eq!(pool.idle_count(), 1);
        let again = get(&pool, &url, true).await;
        assert_eq!((again.status(), again.body().as_ref()), (http::StatusCode::OK, &b"ok"[..]));
        assert_eq!(accepted.load(Ordering::SeqCst), 2, "sent again on a new connection");
        // The second connection is pooled; its next request gets the 408 and goes out on a
        // third connection, whose own 408 is the answer.
        let timed_out = get(&pool, &url, true).await;
        assert_eq!(timed_out.status(), http::StatusCode::REQUEST_TIMEOUT);
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn refused_and_malformed_targets_are_errors() {
        let pool = pool();
        let closed = {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            format!("http://{}", listener.local_addr().unwrap())
        };
        assert!(matches!(pool.send(request(&closed)).await, Err(SendError::Connect(_))));
        assert!(matches!(pool.send(request("ftp://127.0.0.1:1")).await, Err(SendError::BadUrl(_))));
        // A plain HTTP server behind an https:// URL: its answer is no TLS.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let plain = format!("https://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let _ = stream.write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n").await;
        });
        let sent = pool.send(request(&plain)).await;
        assert!(matches!(&sent, Err(SendError::Tls(_))), "{:?}", sent.err());
        let relative = Request::get("/relative").body(Outgoing::Full(Bytes::new())).unwrap();
        assert!(matches!(pool.send(relative).await, Err(SendError::BadUrl(_))));
        // A server that takes the connection and says nothing: the handshake times out.
        let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}", silent.local_addr().unwrap());
        let pool = Arc::new(Pool::new(Duration::from_millis(200), Duration::from_secs(60), 8));
        let sent = pool.send(request(&url)).await;
        assert!(matches!(&sent, Err(SendError::HandshakeTimeout(_))), "{:?}", sent.err());
        drop(silent);
    }

    /// A certificate for 127.0.0.1: the server's acceptor, and its file (under a directory of
    /// the test's own, `name`), for clients to trust.
    fn certificate(name: &str) -> (tokio_rustls::TlsAcceptor, std::path::PathBuf) {
        use tokio_rustls::rustls::{ServerConfig, crypto::ring, pki_types::PrivateKeyDer};
        let made = rcgen::generate_simple_self_signed(vec!["127.0.0.1".into()]).unwrap();
        let dir = std::env::temp_dir().join(format!("kvroute-pool-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = dir.join("ca.crt");
        std::fs::write(&ca, made.cert.pem()).unwrap();
        let key = PrivateKeyDer::try_from(made.signing_key.serialize_der()).unwrap();
        let config = ServerConfig::builder_with_provider(Arc::new(ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![made.cert.der().clone()], key)
            .unwrap();
        (tokio_rustls::TlsAcceptor::from(Arc::new(config)), ca)
    }

    /// A TLS replica that sends bytes past its response, in a record of their own: its
    /// connection is not reused, whether those bytes still wait on the socket or were read (and
    /// decrypted) with the response's last record.
    #[tokio::test]
    async fn a_tls_connection_with_bytes_past_the_response_is_not_reused() {
        use tokio::io::AsyncReadExt;
        let (acceptor, ca) = certificate("junk");
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}", listener.local_addr().unwrap());
        let accepted = Arc::new(AtomicUsize::new(0));
        let (count, sent) = (accepted.clone(), Arc::new(tokio::sync::Notify::new()));
        let junk_sent = sent.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let (Ok(mut stream), sent) = (acceptor.accept(stream).await, sent.clone()) else { continue };
                tokio::spawn(async move {
                    let mut seen = Vec::new();
                    while stream.read_buf(&mut seen).await.is_ok_and(|n| n > 0) {
                        while let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
                            seen.drain(..end + 4);
                            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await;
                            let _ = stream.write_all(b"junk").await;
                            let _ = stream.flush().await;
                            sent.notify_one();
                        }
                    }
                });
            }
        });
        let files = kvroute_proto::serve::ClientFiles { ca: Some(ca.clone()), identity: None };
        let tls = ReplicaTls::from_files(&files).unwrap();
        let pool = Arc::new(Pool::new(Duration::from_secs(2), Duration::from_secs(60), 8).with_tls(tls));
        for _ in 0..2 {
            assert_eq!(get(&pool, &url, true).await.into_body(), "ok");
            junk_sent.notified().await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 2, "a new connection for the second request");
        let _ = std::fs::remove_dir_all(ca.parent().unwrap());
    }

    /// TLS connections are pooled as plain ones, apart from them (an `http://` request to the
    /// same address is not sent on a TLS connection); once the TLS settings change, a connection
    /// made before is not reused, and a reload of unchanged files changes nothing.
    #[tokio::test]
    async fn tls_connections_are_pooled_apart_until_the_settings_change() {
        let (acceptor, ca) = certificate("tls");
        let files = |ca: &std::path::Path| kvroute_proto::serve::ClientFiles {
            ca: Some(ca.to_owned()),
            identity: None,
        };
        let tls = ReplicaTls::from_files(&files(&ca)).unwrap();
        let pool =
            Arc::new(Pool::new(Duration::from_secs(2), Duration::from_secs(60), 8).with_tls(tls.clone()));
        let (url, accepted) = backend_over(true, Some(acceptor)).await;
        for _ in 0..2 {
            assert_eq!(get(&pool, &url, true).await.into_body(), "ok");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "the TLS connection was reused");
        let plain = url.replace("https://", "http://");
        assert!(pool.send(request(&plain)).await.is_err(), "not sent in the TLS connection");
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
        tls.load(&files(&ca)).unwrap();
        assert_eq!(get(&pool, &url, true).await.into_body(), "ok");
        assert_eq!(accepted.load(Ordering::SeqCst), 2, "the same files: the connection stays");
        let moved = ca.with_file_name("moved.crt");
        std::fs::copy(&ca, &moved).unwrap();
        tls.load(&files(&moved)).unwrap();
        assert_eq!(get(&pool, &url, true).await.into_body(), "ok");
        assert_eq!(accepted.load(Ordering::SeqCst), 3, "new settings: a new connection");
        let _ = std::fs::remove_dir_all(ca.parent().unwrap());
    }
}
