//! A client's request body that fails when the client stops sending, whether the router
//! reads it whole (a routed request, which holds an in-flight slot meanwhile) or streams it
//! to a replica (where a stalled upload would otherwise run into the first-byte timeout and
//! be blamed on the replica: 504, counted toward its ejection). Either way it is the
//! client's error ([`client_error`]).

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

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
}

impl<B> Upload<B> {
    pub fn new(inner: B, idle: Duration) -> Self {
        Self { inner, timer: IdleTimer::new(idle) }
    }
}

/// What a failed client body means for the client: too large (413), stalled (408) or
/// unreadable (400).
pub fn client_error(e: &BoxError, limit: usize) -> ProxyError {
    if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() {
        ProxyError::BodyTooLarge { limit }
    } else if let Some(Stalled(idle)) = e.downcast_ref::<Stalled>() {
        ProxyError::BodyTimeout { timeout_ms: idle.as_millis() as u64 }
    } else {
        ProxyError::BodyRead(e.to_string())
    }
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
                Poll::Ready(frame)
            }
            Poll::Pending => match this.timer.poll_expired(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(Stalled(this.timer.idle()).into()))),
                Poll::Pending => Poll::Pending,
            },
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
}
