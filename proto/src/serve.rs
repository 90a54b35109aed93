//! The HTTP accept loop shared by the router and the replica agent: hyper 1 with HTTP/1.1
//! and HTTP/2 (auto-detected), `TCP_NODELAY`, and graceful shutdown — when `shutdown` fires
//! the listener is dropped (new connections are refused), every open connection finishes the
//! requests it is serving (streams included) and then closes, and `serve` returns.
//!
//! [`Limits`] bound what one peer can hold: open connections (at the limit each accept loop
//! holds the one connection it accepted last, unserved, and accepts no more, so the others
//! wait in the kernel's listen backlog until a connection closes), the
//! size and number of request header fields (hyper answers `431` and closes), and the time
//! allowed to send a request head (slowloris), and the time a write to a client that stopped
//! reading may wait ([`send_timeout`]). A connection with no request open for that same
//! header-read timeout is closed gracefully: hyper does so for HTTP/1, and nothing would for
//! an HTTP/2 peer that answers PINGs (a client's pool keeping it), which held its slot for
//! good.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::{Body, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

mod grpc;
mod parts;
pub mod send_timeout;
mod tls;
mod tls_client;
mod watched;

pub use grpc::{GRPC_DRAIN, drained_within, grpc_incoming, grpc_server};
pub use parts::Parts;
use send_timeout::SendTimeout;
pub use tls::{Tls, TlsFiles, certificates, not_after, private_key, read_file};
pub use tls_client::{ClientFiles, ClientTls, client_config, system_client_config};
pub use watched::{FromFiles, Watched};

/// Limits of one HTTP server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections served at once; more wait (one per accept loop accepted, the rest in the
    /// listen backlog).
    pub max_connections: usize,
    /// Largest request head (request line and header fields), bytes: HTTP/1's read buffer
    /// (hyper allows no less than [`MIN_HEADER_BYTES`]) and HTTP/2's header list size.
    pub max_header_bytes: usize,
    /// Most header fields in one HTTP/1 request.
    pub max_headers: usize,
    /// Time allowed for a client to send a whole HTTP/1 request head, for a new connection
    /// (HTTP/1 or HTTP/2) to send its first request's, and for a connection to stay with no
    /// request open before it is closed.
    pub header_read_timeout: Duration,
    /// Longest a write to a client may wait (it is not reading); then the connection
    /// closes ([`send_timeout`]).
    pub send_timeout: Duration,
    /// After shutdown, how long open connections may go on before the server stops waiting
    /// for them: on [`serve_on_threads`]' threads they are then closed where they stand (their
    /// runtime goes); [`serve_with`]'s are left to its caller's runtime. `None`: as long as
    /// they take. [`DEFAULT_DRAIN`] by default: an HTTP/2 client that grants a stream no
    /// window holds it, and a drain without end, for ever (no write waits for the send
    /// timeout to cut).
    pub drain_timeout: Option<Duration>,
}

/// hyper's limit on HTTP/1 request header fields when none is set.
const HYPER_MAX_HEADERS: usize = 100;

/// hyper's smallest HTTP/1 read buffer.
pub const MIN_HEADER_BYTES: usize = 8192;

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 10_000,
            max_header_bytes: 64 * 1024,
            max_headers: 100,
            header_read_timeout: Duration::from_secs(30),
            send_timeout: Duration::from_secs(60),
            drain_timeout: Some(DEFAULT_DRAIN),
        }
    }
}

/// [`Limits::drain_timeout`] by default.
pub const DEFAULT_DRAIN: Duration = Duration::from_secs(30);

/// Work a request starts that must run to its end whether or not its client waits (a change
/// made on several servers, say), in every request's extensions: tasks spawned with
/// [`Background::spawn`] run on the request's runtime, and the server drains them at
/// shutdown as it drains its connections.
#[derive(Clone, Debug)]
pub struct Background(TaskTracker);

impl Background {
    /// Spawns `task`, to be waited for at shutdown.
    pub fn spawn<F>(&self, task: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.0.spawn(task)
    }
}

/// The address of the client a request came from, in every request's extensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer(pub std::net::SocketAddr);

/// In the extensions of every request that came over TLS ([`Tls`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Https;

/// How long an accept loop waits after a failed accept before the next.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(10);

/// Serves `handler` on `listener` with the default [`Limits`] until `shutdown` fires, then
/// drains.
pub async fn serve<H, F, B>(listener: TcpListener, handler: H, shutdown: CancellationToken)
where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<B>> + Send + 'static,
    B: Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    serve_with(listener, handler, Limits::default(), None, shutdown).await;
}

/// [`serve`] with explicit limits, on the current runtime; with `tls`, every connection is a
/// TLS one (as [`serve_on_threads`]'s).
pub async fn serve_with<H, F, B>(
    listener: TcpListener,
    handler: H,
    limits: Limits,
    tls: Option<&Tls>,
    shutdown: CancellationToken,
) where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<B>> + Send + 'static,
    B: Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let connections = TaskTracker::new();
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    accept_loop(listener, handler, (&limits, tls), &slots, &connections, &shutdown).await;
    drain(&connections, limits.drain_timeout).await;
}

/// Waits for `connections` to end, at most `timeout`; past it, says how many are left (their
/// tasks end with their runtime).
async fn drain(connections: &TaskTracker, timeout: Option<Duration>) {
    connections.close();
    let Some(timeout) = timeout else { return connections.wait().await };
    if tokio::time::timeout(timeout, connections.wait()).await.is_err() {
        tracing::warn!(
            open = connections.len(),
            ?timeout,
            "drain timeout: closing the connections still open"
        );
    }
}

/// [`serve_with`] on `threads` threads of their own, each a single-threaded runtime with its
/// own accept loop and its own handler from `make_handler` (so per-thread state, an upstream
/// connection pool say, stays on its thread).
///
/// Each thread listens on a socket of its own on `listener`'s address (`SO_REUSEPORT`; the
/// first is `listener` itself), so the kernel spreads new connections evenly over the
/// threads, as nginx's `reuseport` does. On one shared socket, every thread is woken for each
/// connection and the first to call `accept` takes it: a client opening its connections in a
/// burst gets most of them served by one thread while the others idle (measured: one thread
/// at 99% of a core, the other at 0.2%). Where the address cannot be shared that way, the
/// threads fall back to clones of `listener`. As with nginx's `reuseport`, another process of
/// the same user could then bind the port too.
///
/// With `tls`, every connection is a TLS one (HTTP/2 or HTTP/1.1 by ALPN); a handshake not
/// done within the header-read timeout ends the connection.
///
/// A connection lives on the thread that accepted it, from its first byte to its last:
/// nothing it does wakes another thread, which is what a reverse proxy's small requests
/// spend most of their time on otherwise (the nginx worker model). The price: a request that
/// computes for long (a large prompt through a slow tokenizer) delays the other connections
/// of its thread, where a work-stealing runtime would move them. The connection limit is
/// shared by all threads. Returns once every thread has drained.
pub async fn serve_on_threads<M, H, F, B>(
    listener: TcpListener,
    threads: usize,
    make_handler: M,
    limits: Limits,
    tls: Option<Tls>,
    heartbeats: Heartbeats,
    shutdown: CancellationToken,
) -> std::io::Result<()>
where
    M: Fn() -> H,
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<B>> + Send + 'static,
    B: Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let listeners = per_thread(listener.into_std()?, threads.max(1))?;
    let connections = TaskTracker::new();
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    // A thread that cannot start stops the ones already serving, so the proxy runs whole
    // or not at all.
    let stop = shutdown.child_token();
    let mut done = Vec::new();
    let mut failed = None;
    for (i, listener) in listeners.into_iter().enumerate() {
        let start = || -> std::io::Result<_> {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            let (handler, connections, slots, stop, heartbeats, tls) = (
                make_handler(),
                connections.clone(),
                slots.clone(),
                stop.clone(),
                heartbeats.clone(),
                tls.clone(),
            );
            let (finished, on_finish) = tokio::sync::oneshot::channel::<()>();
            std::thread::Builder::new().name(format!("http-{i}")).spawn(move || {
                runtime.block_on(async move {
                    tokio::spawn(keep_timer_deadline_near(stop.clone(), move || heartbeats.beat(i)));
                    match TcpListener::from_std(listener) {
                        Ok(listener) => {
                            let tls = tls.as_ref();
                            accept_loop(listener, handler, (&limits, tls), &slots, &connections, &stop).await
                        }
                        Err(e) => {
                            tracing::error!(error = %e, "cannot register the listener");
                            stop.cancel();
                        }
                    }
                    // Connections accepted here run on this runtime: keep it until they end
                    // (or the drain timeout closes them, dropping the runtime).
                    drain(&connections, limits.drain_timeout).await;
                });
                let _ = finished.send(());
            })?;
            Ok(on_finish)
        };
        match start() {
            Ok(on_finish) => done.push(on_finish),
            Err(e) => {
                stop.cancel();
                failed = Some(e);
                break;
            }
        }
    }
    // Taken as they end: a thread that panicked (it dropped its end of the channel unsent)
    // stops the others at once, as one that could not start does.
    let mut done: futures::stream::FuturesUnordered<_> = done.into_iter().collect();
    while let Some(ended) = futures::StreamExt::next(&mut done).await {
        if ended.is_err() {
            stop.cancel();
            failed.get_or_insert_with(|| std::io::Error::other("a proxy thread panicked"));
        }
    }
    failed.map_or(Ok(()), Err)
}

/// `threads` listening sockets on `listener`'s address, `listener` first: others bound with
/// `SO_REUSEPORT` if the address allows it, else clones of `listener`.
fn per_thread(
    listener: std::net::TcpListener,
    threads: usize,
) -> std::io::Result<Vec<std::net::TcpListener>> {
    let mut all = Vec::with_capacity(threads);
    if threads > 1 {
        match shared_port(&listener, threads - 1) {
            Ok(others) => all.extend(others),
            Err(e) => {
                tracing::debug!(error = %e, "SO_REUSEPORT unavailable; the HTTP threads share one socket");
                // No other process may bind the port alongside this one after all.
                if let Err(e) = socket2::SockRef::from(&listener).set_reuse_port(false) {
                    tracing::debug!(error = %e, "cannot clear SO_REUSEPORT");
                }
                for _ in 1..threads {
                    all.push(listener.try_clone()?);
                }
            }
        }
    }
    all.insert(0, listener);
    Ok(all)
}

/// `n` more listening sockets on `listener`'s port, the kernel balancing connections over
/// all of them.
fn shared_port(listener: &std::net::TcpListener, n: usize) -> std::io::Result<Vec<std::net::TcpListener>> {
    use socket2::{Domain, SockRef, Socket, Type};
    let address = listener.local_addr()?;
    let first = SockRef::from(listener);
    first.set_reuse_port(true)?;
    (0..n)
        .map(|_| {
            let socket = Socket::new(Domain::for_address(address), Type::STREAM, None)?;
            if address.is_ipv6() {
                socket.set_only_v6(first.only_v6()?)?;
            }
            socket.set_reuse_address(true)?;
            socket.set_reuse_port(true)?;
            socket.set_nonblocking(true)?;
            socket.bind(&address.into())?;
            socket.listen(1024)?;
            Ok(socket.into())
        })
        .collect()
}

/// Keeps a timer due within the second on the current runtime until `stop` fires.
///
/// tokio wakes its driver (an eventfd write and one more epoll event) whenever a new timer is
/// due before the driver's current wake-up deadline. A proxy registers timers on every
/// request (hyper's header-read timeout, the first-byte and idle timeouts), all due seconds
/// away; with nothing sooner pending, each one moved the deadline closer and cost that wake-up.
/// With this tick pending they never do.
///
/// Each tick also calls `beat`: a thread whose ticks stop is stuck ([`Heartbeats`]).
async fn keep_timer_deadline_near(stop: CancellationToken, beat: impl FnMut()) {
    every(Duration::from_millis(500), stop, beat).await;
}

/// Calls `f` every `period`, the first time a period from now, until `stop` fires. A call
/// late (a busy thread) puts the next ones a period after it, rather than running them at once.
pub async fn every(period: Duration, stop: CancellationToken, mut f: impl FnMut()) {
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => f(),
        }
    }
}

/// When each thread of [`serve_on_threads`] last ran its half-second tick. A thread that has
/// not ticked for seconds is stuck (a blocking call, a loop that does not yield), and so is
/// every connection it holds; the other threads and the process may look healthy meanwhile.
#[derive(Clone, Debug)]
pub struct Heartbeats {
    epoch: std::time::Instant,
    /// Milliseconds from `epoch` to each thread's last tick.
    beats: Arc<[std::sync::atomic::AtomicU64]>,
}

impl Heartbeats {
    /// For `threads` threads, each counted as having ticked now.
    pub fn new(threads: usize) -> Self {
        Self { epoch: std::time::Instant::now(), beats: (0..threads).map(|_| Default::default()).collect() }
    }

    fn beat(&self, thread: usize) {
        if let Some(beat) = self.beats.get(thread) {
            let millis = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
            beat.store(millis, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The threads whose last tick was `max_age` or more before `now`.
    pub fn stalled(&self, now: std::time::Instant, max_age: Duration) -> Vec<usize> {
        let age = |millis: u64| now.saturating_duration_since(self.epoch + Duration::from_millis(millis));
        let beats = self.beats.iter().map(|b| b.load(std::sync::atomic::Ordering::Relaxed));
        beats.enumerate().filter(|&(_, millis)| age(millis) >= max_age).map(|(i, _)| i).collect()
    }
}

/// Accepts connections until `shutdown` fires, serving each on a task of the current runtime
/// (tracked by `connections`, holding one of `slots`), then drops the listener.
async fn accept_loop<H, F, B>(
    listener: TcpListener,
    handler: H,
    (limits, tls): (&Limits, Option<&Tls>),
    slots: &Arc<Semaphore>,
    connections: &TaskTracker,
    shutdown: &CancellationToken,
) where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<B>> + Send + 'static,
    B: Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(limits.max_header_bytes.max(MIN_HEADER_BYTES));
    // hyper's own limit is the same without setting it, and then its parser's header arrays
    // are left uninitialized instead of being filled for every request (~2% of the proxy's
    // user CPU a request).
    if limits.max_headers != HYPER_MAX_HEADERS {
        builder.http1().max_headers(limits.max_headers);
    }
    // An HTTP/2 peer that stops answering PINGs within the header-read timeout is closed:
    // hyper reaps idle HTTP/1 connections with that timer, but nothing else would close a
    // silent or half-open HTTP/2 one (nor let a graceful shutdown, which waits for the
    // peer's PING acknowledgement, end).
    builder
        .http2()
        .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX))
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(limits.header_read_timeout))
        .keep_alive_timeout(limits.header_read_timeout);
    loop {
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
        };
        // At the connection limit, this connection waits for one to close and the loop
        // accepts no other. (Waiting before `accept` instead would strand a connection the
        // kernel queued on this thread's socket while another thread's loop took the slot.)
        // A shutdown meanwhile serves it all the same, without a slot: it was accepted, and
        // its request is likely in (dropped, it was reset, the client answered nothing). It
        // is read first, then closed gracefully like every other, and it is the loop's last.
        let slot = tokio::select! {
            _ = shutdown.cancelled() => None,
            slot = slots.clone().acquire_owned() => Some(slot.expect("the semaphore is never closed")),
        };
        let last = slot.is_none();
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, %peer, "cannot set TCP_NODELAY");
        }
        let connection = Connection {
            builder: builder.clone(),
            handler: handler.clone(),
            peer,
            send_timeout: limits.send_timeout,
            first_request_by: tokio::time::Instant::now() + limits.header_read_timeout,
            first_request_timeout: limits.header_read_timeout,
            background: Background(connections.clone()),
            shutdown: shutdown.clone(),
        };
        let acceptor = tls.map(Tls::acceptor);
        connections.spawn(async move {
            let _slot = slot;
            match acceptor {
                None => connection.serve(tls::Stream::Plain(stream)).await,
                Some(acceptor) => {
                    // Within the time its first request is due in: a peer that never finishes
                    // its handshake would hold its slot for good.
                    let handshake = acceptor.accept(stream);
                    match tokio::time::timeout_at(connection.first_request_by, handshake).await {
                        Ok(Ok(stream)) => connection.serve(tls::Stream::Tls(Box::new(stream))).await,
                        Ok(Err(e)) => tracing::debug!(error = %e, %peer, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake not done in time"),
                    }
                }
            }
        });
        if last {
            break;
        }
    }
    drop(listener);
}

/// What serving one accepted connection needs.
struct Connection<H> {
    builder: hyper_util::server::conn::auto::Builder<TokioExecutor>,
    handler: H,
    peer: std::net::SocketAddr,
    send_timeout: Duration,
    /// When its first request must have come (a TLS handshake included).
    first_request_by: tokio::time::Instant,
    first_request_timeout: Duration,
    background: Background,
    shutdown: CancellationToken,
}

impl<H> Connection<H> {
    /// Serves the connection's requests on `stream` until it ends.
    async fn serve<F, B>(self, stream: tls::Stream)
    where
        H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
        F: Future<Output = Response<B>> + Send + 'static,
        B: Body + Send + Unpin + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let Connection {
            builder,
            handler,
            peer,
            send_timeout,
            first_request_by,
            first_request_timeout,
            background,
            shutdown,
        } = self;
        let https = matches!(stream, tls::Stream::Tls(_));
        let activity = Arc::new(Activity::default());
        let service = hyper::service::service_fn({
            let activity = activity.clone();
            move |mut req: Request<Incoming>| {
                let open = Open::new(&activity);
                req.extensions_mut().insert(background.clone());
                req.extensions_mut().insert(Peer(peer));
                if https {
                    req.extensions_mut().insert(Https);
                }
                let response = handler(req);
                async move { Ok::<_, Infallible>(response.await.map(|body| Tracked { body, _open: open })) }
            }
        });
        // With upgrades: a handler that answers `101` (the router tunnelling a WebSocket)
        // is handed the connection's socket through `hyper::upgrade::on`.
        let conn = builder
            .serve_connection_with_upgrades(TokioIo::new(SendTimeout::new(stream, send_timeout)), service);
        tokio::pin!(conn);
        // hyper's header-read timer starts once it knows the protocol, which it learns from
        // the first bytes: a connection that sends none (or a part of HTTP/2's preface)
        // would hold its slot for good. Its first request is due within the same time.
        // The same timer runs whenever no request is open: a connection left idle for that
        // long (an HTTP/2 one especially: hyper closes idle HTTP/1 ones alike) is closed.
        let mut idle = Some(Box::pin(tokio::time::sleep_until(first_request_by)));
        let (mut closing, mut shutting_down) = (false, false);
        let result = loop {
            tokio::select! {
                // The connection first: a request that came as the timer fired is seen.
                biased;
                result = conn.as_mut() => break result,
                // The idle timer still runs while the connection drains.
                _ = shutdown.cancelled(), if !shutting_down => {
                    conn.as_mut().graceful_shutdown();
                    shutting_down = true;
                }
                // While it closes too: a stream the client opened before it saw the GOAWAY
                // is served to its end.
                () = activity.wait() => {
                    idle = (!activity.busy()).then(|| Box::pin(tokio::time::sleep(first_request_timeout)));
                }
                () = elapsed(&mut idle) => {
                    if closing {
                        return;
                    }
                    // An HTTP/2 client is told (GOAWAY), and has as long again to go; a
                    // request that still comes is served to its end. A connection still
                    // being read for its protocol ends at once.
                    tracing::debug!(%peer, "no request open for the header-read timeout: closing");
                    conn.as_mut().graceful_shutdown();
                    closing = true;
                    idle = Some(Box::pin(tokio::time::sleep(first_request_timeout)));
                }
            }
        };
        if let Err(e) = result {
            tracing::debug!(error = %e, %peer, "connection ended with an error");
        }
    }
}

/// Waits for `timer` (for ever without one).
async fn elapsed(timer: &mut Option<std::pin::Pin<Box<tokio::time::Sleep>>>) {
    match timer {
        Some(timer) => timer.await,
        None => std::future::pending().await,
    }
}

/// How many requests of a connection are open (from their head to their response's end),
/// and a wake-up when none or the first is.
#[derive(Default)]
struct Activity {
    open: std::sync::atomic::AtomicUsize,
    notify: tokio::sync::Notify,
}

impl Activity {
    fn busy(&self) -> bool {
        self.open.load(std::sync::atomic::Ordering::Acquire) > 0
    }

    async fn wait(&self) {
        self.notify.notified().await;
    }
}

/// One open request of a connection, until its response's body is done with.
struct Open(Arc<Activity>);

impl Open {
    fn new(activity: &Arc<Activity>) -> Self {
        if activity.open.fetch_add(1, std::sync::atomic::Ordering::AcqRel) == 0 {
            activity.notify.notify_one();
        }
        Self(activity.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        if self.0.open.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1 {
            self.0.notify.notify_one();
        }
    }
}

/// A response body that holds its request open until hyper is done with it.
struct Tracked<B> {
    body: B,
    _open: Open,
}

impl<B: Body + Unpin> Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<B::Data>, B::Error>>> {
        std::pin::Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http_body_util::Full;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// How long a test waits for what must come.
    const WAIT: Duration = Duration::from_secs(30);

    /// `future`'s output, or a failure if it takes longer than [`WAIT`].
    async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
        tokio::time::timeout(WAIT, future).await.unwrap_or_else(|_| panic!("{what}: nothing within {WAIT:?}"))
    }

    /// Sends one HTTP/1.1 request and reads the response until the connection closes.
    async fn get(addr: std::net::SocketAddr) -> String {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await.unwrap();
        let mut response = String::new();
        within("a response", stream.read_to_string(&mut response)).await.unwrap();
        response
    }

    #[tokio::test]
    async fn threads_serve_their_own_connections_and_drain_on_shutdown() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let (entered, release) = (Arc::new(tokio::sync::Notify::new()), Arc::new(tokio::sync::Notify::new()));
        let made = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let make_handler = {
            let (entered, release, made) = (entered.clone(), release.clone(), made.clone());
            move || {
                made.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let (entered, release) = (entered.clone(), release.clone());
                move |req: Request<Incoming>| {
                    let (entered, release) = (entered.clone(), release.clone());
                    async move {
                        if req.uri().path() == "/slow" {
                            entered.notify_one();
                            release.notified().await;
                        }
                        let name = std::thread::current().name().unwrap_or("?").to_owned();
                        Response::new(Full::new(Bytes::from(name)))
                    }
                }
            }
        };
        let server = tokio::spawn(serve_on_threads(
            listener,
            2,
            make_handler,
            Limits::default(),
            None,
            Heartbeats::new(2),
            shutdown.clone(),
        ));
        let mut gets = tokio::task::JoinSet::new();
        for _ in 0..16 {
            gets.spawn(get(addr));
        }
        for a in gets.join_all().await {
            assert!(a.starts_with("HTTP/1.1 200"), "{a}");
            assert!(a.ends_with("http-0") || a.ends_with("http-1"), "served off the HTTP threads: {a}");
        }
        assert_eq!(made.load(std::sync::atomic::Ordering::Relaxed), 2, "one handler per thread");

        // A request in flight when shutdown fires still gets its answer; then serve returns.
        let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
        slow.write_all(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
        within("the slow request's handler", entered.notified()).await;
        shutdown.cancel();
        release.notify_one();
        let mut response = String::new();
        within("the slow request's answer", slow.read_to_string(&mut response)).await.unwrap();
        assert!(response.starts_with("HTTP/1.1 200"), "{response}");
        within("the server's drain", server).await.unwrap().unwrap();
        assert!(tokio::net::TcpStream::connect(addr).await.is_err(), "the listener is closed");
    }

    /// A thread its handler blocks stops ticking and is reported stalled; the other is not.
    #[tokio::test]
    async fn a_blocked_thread_is_reported_stalled() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let make_handler = || {
            |req: Request<Incoming>| async move {
                if req.uri().path() == "/block" {
                    std::thread::sleep(Duration::from_secs(4));
                }
                Response::new(Full::new(Bytes::from(std::thread::current().name().unwrap_or("?").to_owned())))
            }
        };
        let heartbeats = Heartbeats::new(2);
        let server = tokio::spawn(serve_on_threads(
            listener,
            2,
            make_handler,
            Limits::default(),
            None,
            heartbeats.clone(),
            shutdown.clone(),
        ));
        let max_age = Duration::from_secs(2);
        assert!(heartbeats.stalled(std::time::Instant::now(), max_age).is_empty());
        let blocked = tokio::spawn(async move {
            let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
            stream.write_all(b"GET /block HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await.unwrap();
            let mut response = String::new();
            within("a response", stream.read_to_string(&mut response)).await.unwrap();
            response
        });
        let stalled = loop {
            let stalled = heartbeats.stalled(std::time::Instant::now(), max_age);
            if !stalled.is_empty() || blocked.is_finished() {
                break stalled;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let response = within("the blocked request's answer", blocked).await.unwrap();
        assert_eq!(stalled.len(), 1, "{stalled:?}");
        assert!(response.ends_with(&format!("http-{}", stalled[0])), "{stalled:?}: {response}");
        shutdown.cancel();
        within("the server's drain", server).await.unwrap().unwrap();
    }

    /// A client that opens its connections in a burst gets them served by every thread
    /// (one listening socket per thread): on one shared socket the first thread to wake took
    /// most of them.
    #[tokio::test]
    async fn a_burst_of_connections_is_spread_over_the_threads() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let make_handler = || {
            |_: Request<Incoming>| async {
                Response::new(Full::new(Bytes::from(std::thread::current().name().unwrap_or("?").to_owned())))
            }
        };
        let server = tokio::spawn(serve_on_threads(
            listener,
            2,
            make_handler,
            Limits::default(),
            None,
            Heartbeats::new(2),
            shutdown.clone(),
        ));
        let mut streams = Vec::new();
        for _ in 0..64 {
            streams.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        let mut served = std::collections::HashMap::<String, usize>::new();
        for mut stream in streams {
            stream.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await.unwrap();
            let mut response = String::new();
            within("a response", stream.read_to_string(&mut response)).await.unwrap();
            let thread = response.rsplit("\r\n").next().unwrap().to_owned();
            *served.entry(thread).or_default() += 1;
        }
        // The kernel hashes each connection to a socket: fewer than 12 of 64 on one of two
        // has a probability below one in a million.
        assert_eq!(served.len(), 2, "{served:?}");
        assert!(served.values().all(|&n| n >= 12), "{served:?}");
        shutdown.cancel();
        within("the server's drain", server).await.unwrap().unwrap();
    }

    /// An endless response body that tells when it is dropped.
    struct Endless {
        chunk: Bytes,
        dropped: Option<tokio::sync::oneshot::Sender<()>>,
    }

    impl Body for Endless {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Infallible>>> {
            std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(self.chunk.clone()))))
        }
    }

    impl Drop for Endless {
        fn drop(&mut self) {
            if let Some(dropped) = self.dropped.take() {
                let _ = dropped.send(());
            }
        }
    }

    /// A client that stops reading its response has its connection closed once a write has
    /// waited for the send timeout: the response is dropped, and with it whatever it held.
    /// Before, TCP's zero-window probes kept the connection, its slot and the response alive
    /// for as long as the client stayed.
    #[tokio::test]
    async fn a_client_that_stops_reading_is_closed_after_the_send_timeout() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let (dropped, on_drop) = tokio::sync::oneshot::channel();
        let dropped = Arc::new(std::sync::Mutex::new(Some(dropped)));
        let handler = move |_: Request<Incoming>| {
            let dropped = dropped.lock().unwrap().take();
            async move { Response::new(Endless { chunk: Bytes::from(vec![b'x'; 64 * 1024]), dropped }) }
        };
        let limits = Limits { send_timeout: Duration::from_millis(200), ..Limits::default() };
        let server = tokio::spawn(serve_with(listener, handler, limits, None, shutdown.clone()));
        let before = send_timeout::send_timeouts();
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        let mut client = socket.connect(addr).await.unwrap();
        client.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
        tokio::time::timeout(Duration::from_secs(20), on_drop)
            .await
            .expect("the response dropped")
            .expect("signalled by the body");
        assert!(send_timeout::send_timeouts() > before, "counted");
        drop(client);
        shutdown.cancel();
        within("the server's drain", server).await.unwrap();
    }

    /// A server of one connection slot and a 300 ms header-read timeout, answering "fine".
    async fn one_slot_server() -> (std::net::SocketAddr, CancellationToken, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let handler = |_: Request<Incoming>| async { Response::new(Full::new(Bytes::from_static(b"fine"))) };
        let limits = Limits {
            max_connections: 1,
            header_read_timeout: Duration::from_millis(300),
            ..Limits::default()
        };
        (addr, shutdown.clone(), tokio::spawn(serve_with(listener, handler, limits, None, shutdown)))
    }

    /// Connections queued on the listening socket at `port` of 127.0.0.1, not yet accepted
    /// (Linux: a listening socket's `rx_queue` in `/proc/net/tcp`).
    fn queued_at(port: u16) -> Option<u32> {
        let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
        let local = format!("0100007F:{port:04X}");
        table.lines().skip(1).find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let listening = fields.get(1) == Some(&local.as_str()) && fields.get(3) == Some(&"0A");
            let rx = fields.get(4)?.split_once(':')?.1;
            listening.then(|| u32::from_str_radix(rx, 16).ok()).flatten()
        })
    }

    /// A connection accepted while every slot is taken, its request in, is answered when a
    /// shutdown comes before a slot does. It was dropped unread, and the client got a reset.
    #[tokio::test]
    async fn a_connection_waiting_for_a_slot_at_shutdown_is_answered() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let handler = |_: Request<Incoming>| async { Response::new(Full::new(Bytes::from_static(b"fine"))) };
        let limits = Limits { max_connections: 1, ..Limits::default() };
        let server = tokio::spawn(serve_with(listener, handler, limits, None, shutdown.clone()));
        // The one slot, held by an idle keep-alive connection.
        let mut holder = tokio::net::TcpStream::connect(addr).await.unwrap();
        holder.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
        let mut answer = [0u8; 256];
        let n = within("the holder's answer", holder.read(&mut answer)).await.unwrap();
        assert!(answer[..n].starts_with(b"HTTP/1.1 200"));
        let mut waiting = tokio::net::TcpStream::connect(addr).await.unwrap();
        waiting.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await.unwrap();
        if queued_at(addr.port()).is_none() {
            eprintln!("no /proc/net/tcp to see the accept queue in: not checked");
            return;
        }
        within("the waiting connection accepted", async {
            while queued_at(addr.port()) != Some(0) {
                tokio::task::yield_now().await;
            }
        })
        .await;
        shutdown.cancel();
        let mut response = String::new();
        let read = within("the waiting connection's answer", waiting.read_to_string(&mut response)).await;
        assert!(read.is_ok() && response.starts_with("HTTP/1.1 200"), "{read:?} {response:?}");
        drop(holder);
        within("the server's drain", server).await.unwrap();
    }

    /// An HTTP/2 client that keeps an idle connection (it answers PINGs, as a pool does) gives
    /// its slot back after the header-read timeout: nothing closed it, and it held the slot for
    /// good.
    #[tokio::test]
    async fn an_idle_http2_connection_gives_its_slot_back() {
        let (addr, shutdown, server) = one_slot_server().await;
        let io = TokioIo::new(tokio::net::TcpStream::connect(addr).await.unwrap());
        let (mut h2, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .handshake::<_, http_body_util::Empty<Bytes>>(io)
            .await
            .unwrap();
        let kept = tokio::spawn(conn);
        let response =
            h2.send_request(Request::get(format!("http://{addr}/")).body(Default::default()).unwrap());
        let body = response.await.unwrap().into_body();
        http_body_util::BodyExt::collect(body).await.unwrap();
        // The client keeps the connection, idle; another one is served once it is closed.
        let other = tokio::time::timeout(Duration::from_secs(10), get(addr)).await;
        assert!(other.expect("the idle connection gave its slot back").contains("fine"));
        kept.await.unwrap().ok();
        drop(h2);
        shutdown.cancel();
        within("the server's drain", server).await.unwrap();
    }

    /// A shutdown does not wait for ever on an HTTP/2 peer that went silent after its preface
    /// (hyper's graceful close waits for the peer to acknowledge a PING), nor on one that sent a
    /// request and then went silent (its slot was held until the process was killed).
    #[tokio::test]
    async fn a_silent_http2_peer_neither_holds_a_slot_nor_the_shutdown() {
        const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";
        // HEADERS, stream 1, END_STREAM | END_HEADERS: GET / over http, :authority x.
        const GET: &[u8] = b"\0\0\x06\x01\x05\0\0\0\x01\x82\x86\x84\x41\x01\x78";
        for (request, shut_down) in [(false, true), (true, false)] {
            let (addr, shutdown, server) = one_slot_server().await;
            let mut peer = tokio::net::TcpStream::connect(addr).await.unwrap();
            peer.write_all(PREFACE).await.unwrap();
            if request {
                peer.write_all(GET).await.unwrap();
            }
            if shut_down {
                shutdown.cancel();
                tokio::time::timeout(Duration::from_secs(10), server)
                    .await
                    .expect("the shutdown was not held up")
                    .unwrap();
            } else {
                let answer = tokio::time::timeout(Duration::from_secs(10), get(addr))
                    .await
                    .expect("the silent peer's slot came free");
                assert!(answer.ends_with("fine"), "{answer}");
                shutdown.cancel();
                within("the server's drain", server).await.unwrap();
            }
            drop(peer);
        }
    }

    /// Over TLS, a connection that does not finish its handshake (it sends nothing, or half a
    /// ClientHello) is closed within the header-read timeout, and its slot serves the next; a
    /// request over TLS is served.
    #[tokio::test]
    async fn an_unfinished_tls_handshake_gives_its_slot_back() {
        use tokio_rustls::rustls::{ClientConfig, RootCertStore, crypto::ring, pki_types::ServerName};
        let (cert, key, made) = tls::test_files("serve");
        let tls = Tls::from_files(&TlsFiles { cert: cert.clone(), key, client_ca: None }).unwrap();
        let _ = std::fs::remove_dir_all(cert.parent().unwrap());
        let mut roots = RootCertStore::empty();
        roots.add(made.cert.der().clone()).unwrap();
        let client = ClientConfig::builder_with_provider(Arc::new(ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let connector = tokio_rustls::TlsConnector::from(Arc::new(client));

        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let make_handler =
            || |_: Request<Incoming>| async { Response::new(Full::new(Bytes::from_static(b"fine"))) };
        let limits = Limits {
            max_connections: 1,
            header_read_timeout: Duration::from_millis(300),
            ..Limits::default()
        };
        let server = tokio::spawn(serve_on_threads(
            listener,
            1,
            make_handler,
            limits,
            Some(tls),
            Heartbeats::new(1),
            shutdown.clone(),
        ));
        for opening in [&b""[..], &[0x16, 0x03, 0x01, 0x02, 0x00, 0x01][..]] {
            let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
            silent.write_all(opening).await.unwrap();
            let served = async {
                let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
                let name = ServerName::try_from("localhost").unwrap();
                let mut stream = connector.connect(name, tcp).await.unwrap();
                stream.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await.unwrap();
                let mut response = Vec::new();
                let _ = stream.read_to_end(&mut response).await;
                String::from_utf8_lossy(&response).into_owned()
            };
            let answer = within("the slot coming free", served).await;
            assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("fine"), "{answer}");
            let mut rest = Vec::new();
            let read = within("the unfinished handshake's close", silent.read_to_end(&mut rest)).await;
            assert!(read.is_ok(), "closed: {rest:?}");
        }
        shutdown.cancel();
        within("the server's drain", server).await.unwrap().unwrap();
    }

    /// A connection that sends no request (nothing at all, or part of HTTP/2's preface, which
    /// hyper reads before any of its timers runs) is closed after the header-read timeout:
    /// it does not hold a connection slot for good.
    #[tokio::test]
    async fn a_connection_that_sends_no_request_is_closed() {
        for opening in [&b""[..], b"PRI * HTTP/2.0\r\n"] {
            let (addr, shutdown, server) = one_slot_server().await;
            let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
            silent.write_all(opening).await.unwrap();
            let answer = tokio::time::timeout(Duration::from_secs(10), get(addr))
                .await
                .unwrap_or_else(|_| panic!("the slot came free after {opening:?}"));
            assert!(answer.ends_with("fine"), "{answer}");
            let mut rest = Vec::new();
            let read = tokio::time::timeout(Duration::from_secs(10), silent.read_to_end(&mut rest)).await;
            assert!(read.is_ok_and(|read| read.is_ok_and(|n| n == 0)), "closed without an answer: {rest:?}");
            shutdown.cancel();
            within("the server's drain", server).await.unwrap();
        }
    }
}
