//! A client's request body that fails when the client stops sending, whether the router
//! reads it whole (a routed request) or streams it to a replica (where a stalled upload
//! would otherwise run into the first-byte timeout and be blamed on the replica: 504,
//! counted toward its ejection). Either way it is the client's error ([`client_error`]).
//!
//! A streamed upload also tracks how far it got ([`Progress`]): the replica's first-byte
//! timeout counts from when the upload went through, so a slow but steady upload is not
//! blamed on the replica either; while it is going, the replica must take some of it every
//! first-byte timeout (a replica that stops reading an upload is not waited on forever).

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

use super::body::BoxError;
use super::error::ProxyError;
use super::idle::IdleTimer;
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

/// The client sent nothing of its body for this long.
#[derive(Debug, thiserror::Error)]
#[error("the request body stalled for {} ms", .0.as_millis())]
pub struct Stalled(pub Duration);

/// `inner`, failing with [`Stalled`] when it has had no frame ready for `idle`.
pub struct Upload<B> {
    inner: B,
    timer: IdleTimer,
    progress: Option<Progress>,
}

impl<B> Upload<B> {
    pub fn new(inner: B, idle: Duration) -> Self {
        Self { inner, timer: IdleTimer::new(idle), progress: None }
    }

    /// Records in `progress` each time the body is read, and when it has all gone through.
    pub fn tracking(mut self, progress: Progress) -> Self {
        self.progress = Some(progress);
        self
    }
}

/// An upload whose body is dropped has gone as far as it will: one the exchange did not
/// need to read (no body: `GET`), or that it stopped reading once its length went out (an
/// HTTP/2 client that ends the stream in a frame of its own) is through; one that failed
/// ended its exchange anyway.
impl<B> Drop for Upload<B> {
    fn drop(&mut self) {
        if let Some(progress) = &self.progress {
            progress.finish();
        }
    }
}

/// How far an upload got: when its body was last read, and when it went through whole;
/// cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct Progress(Arc<Marks>);

#[derive(Debug, Default)]
struct Marks {
    read: Mutex<Option<Instant>>,
    /// The body is waiting for the client's next bytes (its silence is the idle timer's).
    waiting: AtomicBool,
    finished: OnceLock<Instant>,
}

impl Progress {
    /// When the upload went through whole, if it has.
    pub fn finished_at(&self) -> Option<Instant> {
        self.0.finished.get().copied()
    }

    /// When a frame of the upload was last read, if one was.
    pub fn read_at(&self) -> Option<Instant> {
        *self.0.read.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the upload is waiting for the client's next bytes (not for the replica to
    /// take the last ones).
    pub fn waiting_on_client(&self) -> bool {
        self.0.waiting.load(Ordering::Relaxed)
    }

    fn read(&self) {
        self.0.waiting.store(false, Ordering::Relaxed);
        *self.0.read.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
    }

    fn finish(&self) {
        let _ = self.0.finished.set(Instant::now());
    }
}

/// What a failed client body means for the client: too large (413), stalled (408), cut off
/// by the client's leaving (its connection closed or reset mid-body: 499, as a client that
/// left) or unreadable (400).
pub fn client_error(e: &BoxError, limit: usize) -> ProxyError {
    if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() {
        ProxyError::BodyTooLarge { limit }
    } else if let Some(Stalled(idle)) = e.downcast_ref::<Stalled>() {
        ProxyError::BodyTimeout { timeout_ms: idle.as_millis() as u64 }
    } else if e.downcast_ref::<hyper::Error>().is_some_and(client_left) {
        ProxyError::ClientLeft
    } else {
        ProxyError::BodyRead(e.to_string())
    }
}

/// Whether `e`, reading a request body, is its client's leaving: the connection ended or was
/// reset before the body did, or (HTTP/2) the client reset its stream.
fn client_left(e: &hyper::Error) -> bool {
    let lost = |io: &std::io::Error| {
        matches!(
            io.kind(),
            std::io::ErrorKind::ConnectionReset
                | std::io::ErrorKind::ConnectionAborted
                | std::io::ErrorKind::BrokenPipe
                | std::io::ErrorKind::UnexpectedEof
        )
    };
    if e.is_incomplete_message() || e.is_canceled() || e.is_closed() {
        return true;
    }
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(h2) = s.downcast_ref::<h2::Error>() {
            // A reset or a GOAWAY the client sent, or its connection lost (not a GOAWAY the
            // server sent over the client's protocol error).
            return ((h2.is_reset() || h2.is_go_away()) && h2.is_remote()) || h2.is_io();
        }
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            return lost(io);
        }
        source = s.source();
    }
    false
}

impl<B> Body for Upload<B>
where
    B: Body<Data = Bytes, Error = BoxError> + Unpin,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                this.timer.progress();
                if let Some(progress) = &this.progress {
                    progress.read();
                    let whole = match &frame {
                        None => true,
                        Some(Ok(_)) => this.inner.is_end_stream(),
                        Some(Err(_)) => false,
                    };
                    if whole {
                        progress.finish();
                    }
                }
                Poll::Ready(frame)
            }
            Poll::Pending => {
                if let Some(progress) = &this.progress {
                    progress.0.waiting.store(true, Ordering::Relaxed);
                }
                match this.timer.poll_expired(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(Stalled(this.timer.limit()).into()))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_body_that_keeps_coming_passes_and_one_that_stops_fails() {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(4);
        let inner = http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        let mut body = Upload::new(inner, Duration::from_secs(1));
        // Time before the body is first read does not count.
        tokio::time::sleep(Duration::from_secs(5)).await;
        // Frames 0.9 s apart, each awaited as it comes: never idle for a whole second.
        let sender = tokio::spawn(async move {
            for _ in 0..3 {
                tokio::time::sleep(Duration::from_millis(900)).await;
                tx.send(Ok(Frame::data(Bytes::from_static(b"part")))).await.unwrap();
            }
            tx
        });
        for _ in 0..3 {
            assert!(body.frame().await.unwrap().unwrap().is_data());
        }
        let tx = sender.await.unwrap();
        // Nothing more comes (the paused clock jumps to each timer): still waiting just short
        // of a second, failed at the second.
        let early = tokio::time::timeout(Duration::from_millis(999), body.frame()).await;
        assert!(early.is_err(), "failed before a whole second of silence");
        let late = tokio::time::timeout(Duration::from_millis(2), body.frame()).await;
        let error = late.expect("failed at a whole second of silence").unwrap().unwrap_err();
        assert!(error.downcast_ref::<Stalled>().is_some(), "{error}");
        drop(tx);
    }

    #[tokio::test(start_paused = true)]
    async fn an_upload_marks_when_it_went_through_whole() {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(4);
        let inner = http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        let finished = Progress::default();
        let mut body = Upload::new(inner, Duration::from_secs(1)).tracking(finished.clone());
        tx.send(Ok(Frame::data(Bytes::from_static(b"part")))).await.unwrap();
        assert!(body.frame().await.unwrap().is_ok());
        assert_eq!(finished.finished_at(), None, "more may come");
        assert_eq!(finished.read_at(), Some(Instant::now()));
        tokio::time::sleep(Duration::from_millis(500)).await;
        drop(tx);
        assert!(body.frame().await.is_none());
        assert_eq!(finished.finished_at(), Some(Instant::now()));

        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(4);
        let inner = http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        let waits = Progress::default();
        let mut body = Upload::new(inner, Duration::from_secs(1)).tracking(waits.clone());
        assert!(!waits.waiting_on_client(), "not asked yet");
        assert!(futures::poll!(body.frame()).is_pending());
        assert!(waits.waiting_on_client(), "asked, and the client has sent nothing");
        tx.send(Ok(Frame::data(Bytes::from_static(b"part")))).await.unwrap();
        assert!(body.frame().await.unwrap().is_ok());
        assert!(!waits.waiting_on_client(), "a frame came: the upload is on its way to the replica");

        let sized = Progress::default();
        let mut body = Upload::new(
            http_body_util::Full::new(Bytes::from_static(b"all")).map_err(|e| match e {}),
            Duration::from_secs(1),
        )
        .tracking(sized.clone());
        assert!(body.frame().await.unwrap().is_ok());
        assert!(sized.finished_at().is_some(), "a body of known length is whole with its last frame");
    }
}
