//! Response bodies: the router's own (small, complete) and upstream ones passed through
//! frame by frame — never buffered, so SSE chunks reach the client as the replica sends them.
//!
//! [`Tracked`] wraps an upstream body and, as frames pass: enforces the idle timeout
//! between frames, picks `"cached_tokens": N` out of the bytes (the realized prefix hit from
//! `usage`, whether it arrives in a JSON body or in the last SSE chunk, even split across
//! frames), tells its [`Hooks`] when the first data passes (the prefill is over) and, on end,
//! error or client disconnect, releases the request's load accounting exactly once.
//!
//! What a client sees when a replica fails in the middle of a response (it died, its
//! connection broke, or it stayed silent past the idle timeout): a server-sent-event stream
//! that stopped at an event boundary gets one final OpenAI error event,
//! `data: {"error":{"message":..,"type":"server_error",..}}`, and then ends cleanly without
//! `data: [DONE]` — the same contract the replica agent keeps for its own failures, so a
//! client tells a failed stream from a finished one. Any other body (a non-streamed JSON
//! answer, or a stream cut inside an event) is aborted: the client's connection reports an
//! incomplete message.

use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use kvroute_proto::openai::OpenAiError;
use tokio::time::{Instant, Sleep};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Every response body the proxy returns.
pub type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

/// A complete body.
pub fn full(bytes: Bytes) -> ProxyBody {
    http_body_util::Full::new(bytes).map_err(|never| match never {}).boxed_unsync()
}

/// Hooks of a tracked body.
pub trait Hooks: Send + 'static {
    /// The first data frame is passing through (the replica produced its first output).
    fn first_data(&mut self);
    /// Called exactly once, when the body ends, fails or is dropped: `cached_tokens` as found
    /// in the body (if any).
    fn finish(self: Box<Self>, cached_tokens: Option<u64>);
}

/// An upstream body with an idle timeout, usage sniffing and an end hook.
pub struct Tracked<B> {
    inner: B,
    idle: Duration,
    sleep: Pin<Box<Sleep>>,
    scanner: UsageScanner,
    hooks: Option<Box<dyn Hooks>>,
    seen_data: bool,
    /// The body is a server-sent-event stream (failures end it with an error event).
    sse: bool,
    /// Everything passed so far ends at an event boundary (`\n\n`).
    at_boundary: bool,
    /// The final error event was sent: the body is over.
    done: bool,
}

impl<B> Tracked<B> {
    pub fn new(inner: B, idle: Duration, hooks: Box<dyn Hooks>) -> Self {
        Self {
            inner,
            idle,
            sleep: Box::pin(tokio::time::sleep(idle)),
            scanner: UsageScanner::default(),
            hooks: Some(hooks),
            seen_data: false,
            sse: false,
            at_boundary: true,
            done: false,
        }
    }

    /// Marks the body as a server-sent-event stream.
    pub fn sse(mut self, sse: bool) -> Self {
        self.sse = sse;
        self
    }

    /// The upstream failed with `error`: an error event if the stream allows one, else the
    /// error itself (which aborts the client's response).
    fn fail(&mut self, error: BoxError) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.end();
        if !(self.sse && self.at_boundary) {
            return Poll::Ready(Some(Err(error)));
        }
        self.done = true;
        let message = format!("the replica's stream failed: {error}");
        let event = OpenAiError::new("server_error", message).to_json();
        let event = [b"data: ".as_slice(), &event, b"\n\n"].concat();
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(event)))))
    }

    fn end(&mut self) {
        if let Some(hooks) = self.hooks.take() {
            hooks.finish(self.scanner.cached_tokens);
        }
    }
}

impl<B> Drop for Tracked<B> {
    fn drop(&mut self) {
        self.end();
    }
}

/// The idle timeout fired inside a response.
#[derive(Debug, thiserror::Error)]
#[error("the replica sent nothing for {0:?}")]
pub struct IdleTimeout(Duration);

impl<B> Body for Tracked<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    if !this.seen_data {
                        this.seen_data = true;
                        if let Some(hooks) = this.hooks.as_mut() {
                            hooks.first_data();
                        }
                    }
                    this.scanner.feed(data);
                    if !data.is_empty() {
                        this.at_boundary = data.ends_with(b"\n\n") || data.ends_with(b"\r\n\r\n");
                    }
                }
                if this.inner.is_end_stream() {
                    // The last frame: hyper will not poll again (the length is known), so
                    // the body ends here, its connection clean.
                    this.end();
                } else {
                    let deadline = Instant::now() + this.idle;
                    this.sleep.as_mut().reset(deadline);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => this.fail(e.into()),
            Poll::Ready(None) => {
                this.end();
                Poll::Ready(None)
            }
            Poll::Pending => {
                ready!(this.sleep.as_mut().poll(cx));
                let idle = this.idle;
                this.fail(Box::new(IdleTimeout(idle)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        // A stream may get a final error event: never promise an exact length.
        if self.sse { SizeHint::default() } else { self.inner.size_hint() }
    }
}

/// Finds the last `"cached_tokens": N` in a byte stream, across frame boundaries.
#[derive(Default, Debug)]
pub struct UsageScanner {
    /// The tail of the previous frame, in case the pattern straddles two frames.
    carry: Vec<u8>,
    pub cached_tokens: Option<u64>,
}

const KEY: &[u8] = b"\"cached_tokens\"";
/// Longest carry needed: the key, a colon, whitespace and a 20-digit number.
const CARRY: usize = 48;

impl UsageScanner {
    pub fn feed(&mut self, data: &[u8]) {
        let joined;
        let hay: &[u8] = if self.carry.is_empty() {
            data
        } else {
            joined = [self.carry.as_slice(), data].concat();
            &joined
        };
        let mut pos = 0;
        while let Some(off) = find(&hay[pos..], KEY) {
            let start = pos + off + KEY.len();
            if let Some(n) = parse_value(&hay[start..]) {
                self.cached_tokens = Some(n);
            }
            pos = start;
        }
        let keep = hay.len().min(CARRY);
        self.carry = hay[hay.len() - keep..].to_vec();
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// `: 123` → 123; `None` if the number is cut off at the end (the next frame completes it).
fn parse_value(rest: &[u8]) -> Option<u64> {
    let rest = rest.trim_ascii_start().strip_prefix(b":")?.trim_ascii_start();
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 || digits == rest.len() {
        return None;
    }
    std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_cached_tokens_in_json_and_across_frames() {
        let body = br#"{"usage":{"prompt_tokens":40,"prompt_tokens_details":{"cached_tokens":32}}}"#;
        for split in 0..body.len() {
            let mut s = UsageScanner::default();
            s.feed(&body[..split]);
            s.feed(&body[split..]);
            assert_eq!(s.cached_tokens, Some(32), "split at {split}");
        }
        let mut s = UsageScanner::default();
        s.feed(b"data: {\"choices\":[]}\n\ndata: [DONE]\n\n");
        assert_eq!(s.cached_tokens, None);
        s.feed(b"{\"cached_tokens\" : 7}{\"cached_tokens\":9}");
        assert_eq!(s.cached_tokens, Some(9), "the last one wins");
    }

    /// Whether a body ended, and the cached tokens it found.
    type Ending = std::sync::Arc<std::sync::Mutex<Option<Option<u64>>>>;

    /// Records how the body ended.
    struct Ended(Ending);

    impl Hooks for Ended {
        fn first_data(&mut self) {}
        fn finish(self: Box<Self>, cached_tokens: Option<u64>) {
            *self.0.lock().unwrap() = Some(cached_tokens);
        }
    }

    /// A body of known length ends with its last frame: whoever serves it stops polling
    /// there, and the request's load must be released then, not when the body is dropped.
    #[tokio::test]
    async fn a_sized_body_completes_with_its_last_frame() {
        let ended = Ending::default();
        let json = Bytes::from_static(br#"{"usage":{"prompt_tokens_details":{"cached_tokens":5}}}"#);
        let inner = http_body_util::Full::new(json);
        let mut body =
            Tracked::new(inner, Duration::from_secs(5), Box::new(Ended(std::sync::Arc::clone(&ended))));
        let frame = body.frame().await.unwrap().unwrap();
        assert!(frame.is_data());
        assert!(body.is_end_stream());
        assert_eq!(*ended.lock().unwrap(), Some(Some(5)), "finished before any further poll");
        drop(body);
        assert_eq!(*ended.lock().unwrap(), Some(Some(5)), "and only once");
    }

    #[tokio::test]
    async fn a_body_dropped_midway_ends_when_dropped() {
        let ended = Ending::default();
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(4);
        tx.send(Ok(Frame::data(Bytes::from_static(b"part")))).await.unwrap();
        let inner = http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        let mut body =
            Tracked::new(inner, Duration::from_secs(5), Box::new(Ended(std::sync::Arc::clone(&ended))));
        body.frame().await.unwrap().unwrap();
        assert_eq!(*ended.lock().unwrap(), None);
        drop(body);
        assert_eq!(*ended.lock().unwrap(), Some(None));
    }
}
