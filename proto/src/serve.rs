//! The HTTP accept loop shared by the router and the replica agent: hyper 1 with HTTP/1.1
//! and HTTP/2 (auto-detected), `TCP_NODELAY`, and graceful shutdown — when `shutdown` fires
//! the listener is dropped (new connections are refused), every open connection finishes the
//! requests it is serving (streams included) and then closes, and `serve` returns.
//!
//! [`Limits`] bound what one peer can hold: open connections (at the limit the loop stops
//! accepting, so new connections wait in the kernel's listen backlog until one closes), the
//! size and number of request header fields (hyper answers `431` and closes), and the time
//! allowed to send a request head (slowloris).

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

/// Limits of one HTTP server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections open at once; more wait in the listen backlog.
    pub max_connections: usize,
    /// Largest request head (request line and header fields), bytes: HTTP/1's read buffer
    /// (hyper allows no less than [`MIN_HEADER_BYTES`]) and HTTP/2's header list size.
    pub max_header_bytes: usize,
    /// Most header fields in one HTTP/1 request.
    pub max_headers: usize,
    /// Time allowed for a client to send a whole HTTP/1 request head.
    pub header_read_timeout: Duration,
}

/// hyper's smallest HTTP/1 read buffer.
pub const MIN_HEADER_BYTES: usize = 8192;

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 10_000,
            max_header_bytes: 64 * 1024,
            max_headers: 100,
            header_read_timeout: Duration::from_secs(30),
        }
    }
}

/// Serves `handler` on `listener` with the default [`Limits`] until `shutdown` fires, then
/// drains.
pub async fn serve<H, F, B>(listener: TcpListener, handler: H, shutdown: CancellationToken)
where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<B>> + Send + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    serve_with(listener, handler, Limits::default(), shutdown).await;
}

/// [`serve`] with explicit limits.
pub async fn serve_with<H, F, B>(
    listener: TcpListener,
    handler: H,
    limits: Limits,
    shutdown: CancellationToken,
) where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<B>> + Send + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let connections = TaskTracker::new();
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(limits.max_header_bytes.max(MIN_HEADER_BYTES))
        .max_headers(limits.max_headers);
    builder.http2().max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX));
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    loop {
        // At the connection limit, stop accepting until a connection closes.
        let slot = tokio::select! {
            _ = shutdown.cancelled() => break,
            slot = slots.clone().acquire_owned() => slot.expect("the semaphore is never closed"),
        };
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, %peer, "cannot set TCP_NODELAY");
        }
        let builder = builder.clone();
        let handler = handler.clone();
        let shutdown = shutdown.clone();
        connections.spawn(async move {
            let _slot = slot;
            let service = hyper::service::service_fn(move |req| {
                let response = handler(req);
                async move { Ok::<_, Infallible>(response.await) }
            });
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(conn);
            let result = tokio::select! {
                result = conn.as_mut() => result,
                _ = shutdown.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = result {
                tracing::debug!(error = %e, %peer, "connection ended with an error");
            }
        });
    }
    drop(listener);
    connections.close();
    connections.wait().await;
}
