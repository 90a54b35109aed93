//! A request body streamed to a replica that fails when the client stops sending: a stalled
//! upload is the client's doing, so it must end as the client's error (408) before the
//! replica's first-byte timeout blames the replica (504, counted toward its ejection).

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

use super::body::{BoxError, ProxyBody};

/// The client sent nothing of its body for this long.
#[derive(Debug, thiserror::Error)]
#[error("the request body stalled for {} ms", .0.as_millis())]
pub struct Stalled(pub Duration);

/// `inner`, failing with [`Stalled`] when no frame comes for `idle`.
pub struct Upload {
    inner: ProxyBody,
    idle: Duration,
    sleep: Pin<Box<Sleep>>,
}

impl Upload {
    pub fn new(inner: ProxyBody, idle: Duration) -> Self {
        Self { inner, idle, sleep: Box::pin(tokio::time::sleep(idle)) }
    }
}

impl Body for Upload {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                this.sleep.as_mut().reset(Instant::now() + this.idle);
                Poll::Ready(frame)
            }
            Poll::Pending => match this.sleep.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(Stalled(this.idle).into()))),
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
        let mut body = Upload::new(inner.boxed_unsync(), Duration::from_secs(1));
        // Frames 0.9 s apart: never idle for a whole second.
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_millis(900)).await;
            tx.send(Ok(Frame::data(Bytes::from_static(b"part")))).await.unwrap();
            assert!(body.frame().await.unwrap().unwrap().is_data());
        }
        let started = Instant::now();
        let error = body.frame().await.unwrap().unwrap_err();
        assert!(error.downcast_ref::<Stalled>().is_some(), "{error}");
        assert_eq!(started.elapsed(), Duration::from_secs(1));
        drop(tx);
    }
}
