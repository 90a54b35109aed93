//! A client connection that gives up on a client that stops reading.
//!
//! A client that stops reading fills the socket's buffers, and every write then waits. TCP
//! itself never gives up on such a peer (it probes a zero window for as long as the peer
//! acknowledges), so without a deadline the connection, its slot among
//! [`Limits::max_connections`](super::Limits) and whatever its response holds stay for as
//! long as the client likes. [`SendTimeout`] fails a write that has waited for `limit`, and
//! the connection closes (nginx's `send_timeout`: between two writes, not for a whole
//! response). Writes that go through at once, nearly all of them, arm no timer.
//! [`send_timeouts`] counts the connections closed so, in this process.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// Writes failed by a send timeout, in this process.
static SEND_TIMEOUTS: AtomicU64 = AtomicU64::new(0);

/// How many client connections this process closed because a write to the client waited
/// for the send timeout (every server of the process together).
pub fn send_timeouts() -> u64 {
    SEND_TIMEOUTS.load(Ordering::Relaxed)
}

/// `io` whose writes fail once they have waited for `limit`.
pub struct SendTimeout<T> {
    io: T,
    limit: Duration,
    /// The deadline of the write that is waiting, if one is; kept for the next wait.
    timer: Option<Pin<Box<Sleep>>>,
    waiting: bool,
}

impl<T> SendTimeout<T> {
    pub fn new(io: T, limit: Duration) -> Self {
        Self { io, limit, timer: None, waiting: false }
    }

    /// Passes a write's outcome on, starting the wait's deadline when it waits and failing
    /// it when the deadline has passed.
    fn watch<R>(&mut self, outcome: Poll<io::Result<R>>, cx: &mut Context<'_>) -> Poll<io::Result<R>> {
        if outcome.is_ready() {
            self.waiting = false;
            return outcome;
        }
        let deadline = Instant::now() + self.limit;
        let timer = self.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if !self.waiting {
            self.waiting = true;
            timer.as_mut().reset(deadline);
        }
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => {
                SEND_TIMEOUTS.fetch_add(1, Ordering::Relaxed);
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("the client took nothing for {:?}", self.limit),
                )))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for SendTimeout<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for SendTimeout<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let outcome = Pin::new(&mut self.io).poll_write(cx, buf);
        self.watch(outcome, cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let outcome = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.watch(outcome, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let outcome = Pin::new(&mut self.io).poll_flush(cx);
        self.watch(outcome, cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let outcome = Pin::new(&mut self.io).poll_shutdown(cx);
        self.watch(outcome, cx)
    }
}
