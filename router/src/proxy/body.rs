//! Response bodies: the router's own (small, complete) and upstream ones passed through
//! frame by frame — never buffered, so SSE chunks reach the client as the replica sends them.
//!
//! [`Tracked`] wraps an upstream body and, as frames pass: enforces the idle timeout
//! between frames, picks `"cached_tokens": N` out of the bytes (the realized prefix hit from
//! `usage`, whether it arrives in a JSON body or in the last SSE chunk, even split across
//! frames), tells its [`Hooks`] when the first data passes (the prefill is over; in a Responses
//! stream, the first event after its opening ones, [`Opening`]) and, on end,
//! error or client disconnect, releases the request's load accounting exactly once. Given a
//! [`StallWatch`], it is also cut when its client stops taking data ([`super::stalls`]).
//!
//! What a client sees when a replica fails in the middle of a response (it died, its
//! connection broke, or it stayed silent past the idle timeout): a server-sent-event stream
//! that stopped at an event boundary gets one final OpenAI error event,
//! `data: {"error":{"message":..,"type":"server_error",..}}`, its message ending with the
//! request's id as every error of the router's does (to a `/v1/messages` client,
//! Anthropic's `event: error` with `{"type":"error","error":{..}}`), and then ends cleanly
//! without `data: [DONE]`, so that even a client that reads only up to `[DONE]` tells a failed
//! stream from a finished one. (A replica that fails a stream itself sends its error event and,
//! as vLLM does, `[DONE]` after it; the router passes both through.) Any other body (a non-streamed JSON
//! answer, or a stream cut inside an event) is aborted: the client's connection reports an
//! incomplete message.

use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use kvroute_proto::openai::OpenAiError;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::error::{Client, with_request_id};
use super::idle::IdleTimer;
use super::opening::Opening;
use super::stalls::{StallWatch, Watch, Watched};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Every response body the proxy returns.
pub type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

/// A complete body.
pub fn full(bytes: Bytes) -> ProxyBody {
    http_body_util::Full::new(bytes).map_err(|never| match never {}).boxed_unsync()
}

/// Most bytes of a replica's answer the router reads for itself (its `/metrics`, its model
/// list, a LoRA change's answer), not one it passes on.
pub const REPLICA_ANSWER_BYTES: usize = 16 << 20;

/// Reads a replica's answer the router reads for itself whole, refusing one over `limit`
/// bytes: a replica (or whatever answers at its address) is not to grow the router's memory.
pub async fn read_at_most<B>(body: B, limit: usize) -> Result<Bytes, BoxError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    Ok(http_body_util::Limited::new(body, limit).collect().await?.to_bytes())
}

/// Hooks of a tracked body.
pub trait Hooks: Send + 'static {
    /// The first data frame is passing through (the replica produced its first output, here
    /// in `data`).
    fn first_data(&mut self, data: &[u8]);
    /// Each data frame from the first, for as long as it answers `true` (by default only the
    /// first is shown).
    fn watch(&mut self, _data: &[u8]) -> bool {
        false
    }
    /// Called exactly once, when the body ends, fails or is dropped: how it ended, and what
    /// its `usage` showed.
    fn finish(self: Box<Self>, end: End, usage: Usage);
}

/// How a tracked body ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// The replica sent all of it.
    Complete,
    /// The replica broke off: its connection failed, or it stayed silent past the idle
    /// timeout.
    Failed,
    /// The client went away or stopped taking data first: nothing to say of the replica.
    Abandoned,
}

/// An upstream body with an idle timeout, usage sniffing and an end hook; given a
/// [`StallWatch`], also cut when its client stops taking data ([`super::stalls`]).
pub struct Tracked<B> {
    held: Held<B>,
    /// The idle deadline of the current wait on the replica.
    timer: IdleTimer,
    /// The watch to hand the body to once it has passed a frame and is still open.
    watch: Option<Arc<StallWatch>>,
}

/// A tracked body's state: its own, or shared with the stall watch (then behind a lock).
enum Held<B> {
    Own(State<B>),
    Shared(Arc<Mutex<State<B>>>),
}

/// What a tracked body holds; dropping it releases the request's load, if not yet released.
struct State<B> {
    /// The upstream body; gone once cut.
    inner: Option<B>,
    scanner: UsageScanner,
    hooks: Option<Box<dyn Hooks>>,
    /// The replica's output has begun (its first data, or past a Responses stream's
    /// opening events).
    seen_data: bool,
    /// A Responses stream's opening events, until its output begins ([`Opening`]).
    opening: Option<Opening>,
    /// Fires at the router's drain timeout: the stream ends at its next frame or wait (read
    /// without registering a wake-up, which would lock the token's one list of waiters, shared
    /// by every thread, at each wait of every stream; a silent stream is closed with its
    /// connection a second later).
    ending: Option<CancellationToken>,
    /// The hooks want to see the frames ([`Hooks::watch`]).
    watching: bool,
    /// The body is a server-sent-event stream (failures end it with an error event in the
    /// envelope of this client's API, naming the request's id).
    sse: Option<(Client, Box<str>)>,
    /// The last four bytes passed, to tell whether everything passed so far ends at an event
    /// boundary ([`at_boundary`]) however the frames split it; `None` before any.
    tail: Option<u32>,
    /// The final error event was sent: the body is over.
    done: bool,
    /// When the last frame was handed over, while nobody has asked for the next one yet
    /// (kept only while watched).
    handed: Option<Instant>,
    /// The stall watch cut the body: its client took nothing for too long.
    cut: bool,
    /// The body had nothing to send from the start (`Content-Length: 0`, a 204): whole,
    /// though nobody may ever read it.
    empty: bool,
}

impl<B> Tracked<B> {
    pub fn new(inner: B, idle: Duration, hooks: Box<dyn Hooks>) -> Self {
        let state = State {
            inner: Some(inner),
            scanner: UsageScanner::default(),
            hooks: Some(hooks),
            seen_data: false,
            opening: None,
            ending: None,
            watching: true,
            sse: None,
            tail: None,
            done: false,
            handed: None,
            cut: false,
            empty: false,
        };
        Self { held: Held::Own(state), timer: IdleTimer::new(idle), watch: None }
    }

    /// Lets the wait for the body's first frame last until `deadline` if that is later than
    /// the idle timeout ([`IdleTimer::first_by`]).
    pub fn first_by(mut self, deadline: Instant) -> Self {
        self.timer = self.timer.first_by(deadline);
        self
    }

    /// Marks a body that has nothing to send (its end is complete, read or not).
    pub fn empty(mut self, empty: bool) -> Self {
        match &mut self.held {
            Held::Own(state) => state.empty = empty,
            Held::Shared(shared) => lock(shared).empty = empty,
        }
        self
    }

    /// Marks the body as a server-sent-event stream to a client of this API, for the request
    /// with this id.
    pub fn sse(mut self, sse: Option<(Client, &str)>) -> Self {
        let sse = sse.map(|(client, request_id)| (client, request_id.into()));
        match &mut self.held {
            Held::Own(state) => state.sse = sse,
            Held::Shared(shared) => lock(shared).sse = sse,
        }
        self
    }

    /// Ends the body with an error event when `ending` fires (the router's drain timeout),
    /// as when its replica fails, but counted against nobody.
    pub fn ending(mut self, ending: Option<&CancellationToken>) -> Self {
        let ending = ending.cloned();
        match &mut self.held {
            Held::Own(state) => state.ending = ending,
            Held::Shared(shared) => lock(shared).ending = ending,
        }
        self
    }

    /// Marks the body as a Responses API stream, whose output begins after its opening
    /// events ([`Opening`]).
    pub fn opening(mut self, opening: bool) -> Self {
        let opening = opening.then(Opening::default);
        match &mut self.held {
            Held::Own(state) => state.opening = opening,
            Held::Shared(shared) => lock(shared).opening = opening,
        }
        self
    }

    /// Hands the body to `watch` once it has passed a frame and is still open; from now on
    /// its state is shared with the watch.
    pub fn watched(mut self, watch: Arc<StallWatch>) -> Self {
        self.held = match self.held {
            Held::Own(state) => Held::Shared(Arc::new(Mutex::new(state))),
            shared => shared,
        };
        self.watch = Some(watch);
        self
    }

    fn read<R>(&self, f: impl FnOnce(&State<B>) -> R) -> R {
        match &self.held {
            Held::Own(state) => f(state),
            Held::Shared(shared) => f(&lock(shared)),
        }
    }
}

fn lock<B>(shared: &Mutex<State<B>>) -> MutexGuard<'_, State<B>> {
    shared.lock().unwrap_or_else(|e| e.into_inner())
}

impl<B> State<B> {
    /// The upstream failed with `error`: an error event if the stream allows one, else the
    /// error itself (which aborts the client's response).
    fn fail(&mut self, error: BoxError) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.fail_as(End::Failed, error)
    }

    /// [`Self::fail`], the body's end counted as `end`: the replica's failure if
    /// [`End::Failed`], else the router's own doing (its drain timeout).
    fn fail_as(&mut self, end: End, error: BoxError) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.end(end);
        let Some((client, request_id)) = self.sse.as_ref().filter(|_| at_boundary(self.tail)) else {
            return Poll::Ready(Some(Err(error)));
        };
        self.done = true;
        let message = match end {
            End::Failed => format!("the replica's stream failed: {error}"),
            _ => error.to_string(),
        };
        let message = with_request_id(&message, request_id);
        let error = OpenAiError::new("server_error", message);
        let event = match client {
            Client::OpenAi => [b"data: ".as_slice(), &error.to_json(), b"\n\n"].concat(),
            Client::Anthropic => {
                [b"event: error\ndata: ".as_slice(), &error.to_anthropic_json(), b"\n\n"].concat()
            }
        };
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(event)))))
    }

    fn end(&mut self, end: End) {
        if let Some(hooks) = self.hooks.take() {
            hooks.finish(end, self.scanner.usage);
        }
    }
}

/// Whether bytes ending in `tail` (the last four, [`State::tail`]) end a server-sent event:
/// a blank line, `\n\n` or `\r\n\r\n`; nothing passed yet is a boundary too.
fn at_boundary(tail: Option<u32>) -> bool {
    tail.is_none_or(|t| {
        t & 0xffff == u32::from_be_bytes(*b"\0\0\n\n") || t == u32::from_be_bytes(*b"\r\n\r\n")
    })
}

impl<B> Drop for State<B> {
    fn drop(&mut self) {
        self.end(if self.empty { End::Complete } else { End::Abandoned });
    }
}

impl<B: Send> Watched for Mutex<State<B>> {
    fn check(&self, since: Instant) -> Watch {
        let mut state = lock(self);
        if state.hooks.is_none() {
            return Watch::Ended;
        }
        if state.handed.is_none_or(|at| at > since) {
            return Watch::Keep;
        }
        // Closes the upstream connection unfinished: the replica sees its client gone.
        state.inner = None;
        state.cut = true;
        state.end(End::Abandoned);
        Watch::Cut
    }
}

/// The idle timeout fired inside a response.
#[derive(Debug, thiserror::Error)]
#[error("the replica sent nothing for {0:?}")]
pub struct IdleTimeout(Duration);

/// The router's drain timeout ended a stream.
#[derive(Debug, thiserror::Error)]
#[error("the router is shutting down (its drain timeout passed)")]
pub struct Drained;

/// The stall watch cut a response its client stopped taking.
#[derive(Debug, thiserror::Error)]
#[error("the client took nothing of the response for the send timeout")]
pub struct ClientStalled;

impl<B> Body for Tracked<B>
where
    B: Body<Data = Bytes> + Unpin + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let timer = &mut this.timer;
        match &mut this.held {
            Held::Own(state) => poll_state(state, timer, None, cx),
            Held::Shared(shared) => {
                let shared: &Arc<Mutex<State<B>>> = shared;
                let mut state = lock(shared);
                let watch = Watching { shared, watch: &mut this.watch };
                poll_state(&mut state, timer, Some(watch), cx)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.read(|state| state.done || state.inner.as_ref().is_some_and(Body::is_end_stream))
    }

    fn size_hint(&self) -> SizeHint {
        // A stream may get a final error event: never promise an exact length.
        self.read(|state| match &state.inner {
            Some(inner) if state.sse.is_none() => inner.size_hint(),
            _ => SizeHint::default(),
        })
    }
}

/// A watched body's shared state and the watch it is handed to after its first open frame.
struct Watching<'a, B> {
    shared: &'a Arc<Mutex<State<B>>>,
    watch: &'a mut Option<Arc<StallWatch>>,
}

/// [`Tracked::poll_frame`] on the body's state.
fn poll_state<B>(
    state: &mut State<B>,
    timer: &mut IdleTimer,
    watching: Option<Watching<'_, B>>,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<Frame<Bytes>, BoxError>>>
where
    B: Body<Data = Bytes> + Unpin + Send + 'static,
    B::Error: Into<BoxError>,
{
    state.handed = None;
    if state.done {
        return Poll::Ready(None);
    }
    if state.ending.as_ref().is_some_and(CancellationToken::is_cancelled) {
        // The replica did nothing wrong: the router is going away.
        state.ending = None;
        state.inner = None;
        return state.fail_as(End::Abandoned, Box::new(Drained));
    }
    let Some(inner) = state.inner.as_mut() else {
        // Cut by the stall watch: the error aborts the client's response.
        state.done = true;
        return Poll::Ready(state.cut.then(|| Err(Box::new(ClientStalled) as BoxError)));
    };
    match Pin::new(&mut *inner).poll_frame(cx) {
        Poll::Ready(Some(Ok(frame))) => {
            if let Some(data) = frame.data_ref() {
                if !state.seen_data && state.opening.as_mut().is_none_or(|o| o.output_begins(data)) {
                    state.seen_data = true;
                    state.opening = None;
                    if let Some(hooks) = state.hooks.as_mut() {
                        hooks.first_data(data);
                    }
                }
                if state.watching {
                    state.watching = state.hooks.as_mut().is_some_and(|hooks| hooks.watch(data));
                }
                state.scanner.feed(data);
                if !data.is_empty() {
                    let last = &data[data.len().saturating_sub(4)..];
                    let tail = state.tail.unwrap_or(0);
                    state.tail = Some(last.iter().fold(tail, |t, &b| (t << 8) | u32::from(b)));
                }
            }
            if state.seen_data {
                timer.progress();
            } else {
                timer.opening();
            }
            if inner.is_end_stream() {
                // The last frame: hyper will not poll again (the length is known), so the
                // body ends here, its connection clean.
                state.end(End::Complete);
            } else if let Some(Watching { shared, watch }) = watching {
                state.handed = Some(Instant::now());
                if let Some(watch) = watch.take() {
                    let weak = Arc::downgrade(shared);
                    watch.watch(weak);
                }
            }
            Poll::Ready(Some(Ok(frame)))
        }
        Poll::Ready(Some(Err(e))) => state.fail(e.into()),
        Poll::Ready(None) => {
            state.end(End::Complete);
            Poll::Ready(None)
        }
        Poll::Pending => {
            // The replica's silence counts from here, not from the last frame: hyper may have
            // taken its time to pass that one on.
            ready!(timer.poll_expired(cx));
            state.fail(Box::new(IdleTimeout(timer.limit())))
        }
    }
}

/// What a response's `usage` showed of its prompt.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// The realized prefix hit, if it said: the last `"cached_tokens": N` (OpenAI's), or
    /// `"cache_read_input_tokens": N` (Anthropic's, `/v1/messages`).
    pub cached_tokens: Option<u64>,
    /// A usage's prompt count passed (`"prompt_tokens"`, or `"input_tokens"` of the Responses
    /// and Messages APIs): a usage that says no cached tokens is there. (vLLM leaves them
    /// out when there are none.)
    pub counted: bool,
}

/// Finds a response's [`Usage`] in its byte stream, across frame boundaries.
#[derive(Default, Debug)]
pub struct UsageScanner {
    /// The tail of the previous frame, in case the pattern straddles two frames.
    carry: Vec<u8>,
    pub usage: Usage,
}

/// What every key looked for ends with; [`CACHED`] and [`COUNTED`] are what comes before it.
const STEM: &[u8] = b"tokens\"";
/// A searcher for [`STEM`], built once: `memmem::find` builds one a call, which was most of
/// the scan's cost on a small response (a few searches each).
static STEM_FINDER: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(STEM));
const CACHED: [&[u8]; 2] = [b"\"cached_", b"\"cache_read_input_"];
const COUNTED: [&[u8]; 2] = [b"\"prompt_", b"\"input_"];
/// Longest carry needed: the longest key, a colon, whitespace and a 20-digit number.
const CARRY: usize = 64;

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
        while let Some(off) = STEM_FINDER.find(&hay[pos..]) {
            let (before, after) = (&hay[..pos + off], pos + off + STEM.len());
            pos = after;
            if CACHED.iter().any(|key| before.ends_with(key)) {
                if let Some(n) = parse_value(&hay[after..]) {
                    self.usage.cached_tokens = Some(n);
                }
            } else if COUNTED.iter().any(|key| before.ends_with(key)) && parse_value(&hay[after..]).is_some()
            {
                self.usage.counted = true;
            }
        }
        let keep = hay.len().min(CARRY);
        // `hay` is `data` or a copy: the carry's buffer is free to reuse.
        self.carry.clear();
        self.carry.extend_from_slice(&hay[hay.len() - keep..]);
    }
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
    use prometheus_client::metrics::counter::Counter;

    use super::*;

    #[test]
    fn finds_cached_tokens_in_json_and_across_frames() {
        let body = br#"{"usage":{"prompt_tokens":40,"prompt_tokens_details":{"cached_tokens":32}}}"#;
        for split in 0..body.len() {
            let mut s = UsageScanner::default();
            s.feed(&body[..split]);
            s.feed(&body[split..]);
            assert_eq!(s.usage.cached_tokens, Some(32), "split at {split}");
        }
        let mut s = UsageScanner::default();
        s.feed(b"data: {\"choices\":[]}\n\ndata: [DONE]\n\n");
        assert_eq!(s.usage.cached_tokens, None);
        s.feed(b"{\"cached_tokens\" : 7}{\"cached_tokens\":9}");
        assert_eq!(s.usage.cached_tokens, Some(9), "the last one wins");
        // Anthropic's usage, split anywhere, among keys that begin alike.
        let body =
            br#"{"usage":{"cache_creation_input_tokens":3,"input_tokens":8,"cache_read_input_tokens":32}}"#;
        for split in 0..body.len() {
            let mut s = UsageScanner::default();
            s.feed(&body[..split]);
            s.feed(&body[split..]);
            assert_eq!(s.usage.cached_tokens, Some(32), "split at {split}");
        }
    }

    /// A usage's prompt count is seen, split anywhere, whether or not it says cached tokens
    /// (vLLM leaves them out when there are none); other counts, and text that only names
    /// the keys, are not a usage.
    #[test]
    fn a_usage_is_seen_with_or_without_its_cached_tokens() {
        let usage = |body: &[u8], split: usize| {
            let mut s = UsageScanner::default();
            s.feed(&body[..split]);
            s.feed(&body[split..]);
            s.usage
        };
        let counted = Usage { cached_tokens: None, counted: true };
        for body in [
            &br#"{"usage":{"prompt_tokens":40,"completion_tokens":1,"total_tokens":41}}"#[..],
            br#"data: {"type":"response.completed","response":{"usage":{"input_tokens":40,"output_tokens":1}}}"#,
        ] {
            for split in 0..body.len() {
                assert_eq!(usage(body, split), counted, "{} at {split}", String::from_utf8_lossy(body));
            }
        }
        let with = br#"{"usage":{"prompt_tokens":40,"prompt_tokens_details":{"cached_tokens":32}}}"#;
        assert_eq!(usage(with, 20), Usage { cached_tokens: Some(32), counted: true });
        for body in [
            &br#"{"usage":{"completion_tokens":1,"prompt_tokens_details":null}}"#[..],
            br#"{"choices":[{"text":"say \"prompt_tokens\": 4"}],"usage":null}"#,
        ] {
            assert_eq!(usage(body, 0), Usage::default(), "{}", String::from_utf8_lossy(body));
        }
    }

    /// Whether a body ended, and the cached tokens it found.
    type Ending = std::sync::Arc<std::sync::Mutex<Option<Option<u64>>>>;

    /// Records how the body ended.
    struct Ended(Ending);

    impl Hooks for Ended {
        fn first_data(&mut self, _: &[u8]) {}
        fn finish(self: Box<Self>, _: End, usage: Usage) {
            *self.0.lock().unwrap() = Some(usage.cached_tokens);
        }
    }

    /// Counts `first_data` calls.
    struct FirstData(std::sync::Arc<std::sync::atomic::AtomicUsize>);

    impl Hooks for FirstData {
        fn first_data(&mut self, _: &[u8]) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        fn finish(self: Box<Self>, _: End, _: Usage) {}
    }

    /// A Responses stream's output (its first data, which releases the request's pending
    /// prefill and credits) begins after its opening events; any other stream's with its
    /// first frame.
    #[tokio::test]
    async fn a_responses_streams_output_begins_after_its_opening_events() {
        let frames: [&'static [u8]; 4] = [
            b"event: response.created\ndata: {}\n\n",
            b"event: response.in_progress\ndata: {}\n\n",
            b"event: response.output_item.added\ndata: {}\n\n",
            b"event: response.output_text.delta\ndata: {}\n\n",
        ];
        for (opening, firsts) in [(true, [0, 0, 1, 1]), (false, [1, 1, 1, 1])] {
            let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(8);
            let inner = http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
            let seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let hooks = Box::new(FirstData(seen.clone()));
            let mut body = Tracked::new(inner, Duration::from_secs(5), hooks).opening(opening);
            for (frame, first) in frames.iter().zip(firsts) {
                tx.send(Ok(Frame::data(Bytes::from_static(frame)))).await.unwrap();
                body.frame().await.unwrap().unwrap();
                assert_eq!(seen.load(std::sync::atomic::Ordering::Relaxed), first, "opening {opening}");
            }
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

    /// How a stream whose replica sent `frames` and then failed ends for a `client` of the
    /// request `req-7`: its bytes, or the error that aborted it.
    async fn failed_after(frames: &[&'static str], client: Client) -> Result<String, BoxError> {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(8);
        for frame in frames {
            tx.send(Ok(Frame::data(Bytes::from_static(frame.as_bytes())))).await.unwrap();
        }
        tx.send(Err("cut".into())).await.unwrap();
        let inner = http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        let hooks = Box::new(Ended(Ending::default()));
        let body = Tracked::new(inner, Duration::from_secs(5), hooks).sse(Some((client, "req-7")));
        let bytes = body.collect().await?.to_bytes();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// A stream that fails at an event boundary ends with one error event, in the envelope
    /// its client's API reads, naming the request; however the replica's frames split the
    /// blank line that ends the last event.
    #[tokio::test]
    async fn a_failed_stream_ends_with_an_error_event_its_client_reads() {
        let splits: [&[&str]; 4] = [
            &["event: x\ndata: {}\n\n"],
            &["event: x\ndata: {}\n", "\n"],
            &["event: x\r\ndata: {}\r\n\r", "\n"],
            &["event: x\r\ndata: {}\r", "\n", "\r", "\n"],
        ];
        for (client, start) in [
            (Client::OpenAi, "data: {\"error\":{"),
            (Client::Anthropic, "event: error\ndata: {\"type\":\"error\",\"error\":{"),
        ] {
            for frames in splits {
                let text = failed_after(frames, client).await.expect("ends with an event, not an error");
                let event = text.strip_prefix(&frames.concat()).expect("the replica's bytes, then");
                assert!(
                    event.starts_with(start) && event.ends_with("\n\n"),
                    "{client:?} {frames:?}: {event}"
                );
                let json: serde_json::Value =
                    serde_json::from_str(event.trim_end().rsplit("data: ").next().unwrap()).unwrap();
                let message = json["error"]["message"].as_str().unwrap_or_default();
                assert!(message.contains("cut") && message.contains("(request id req-7)"), "{json}");
            }
        }
        // Cut inside an event: an error event there would be read as part of it.
        for frames in
            [&["event: x\ndata: {}\n"][..], &["data: {}\n\n", "data: {"], &["data: {}\r\n\r\n", "x"]]
        {
            assert!(failed_after(frames, Client::OpenAi).await.is_err(), "{frames:?}");
        }
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

    /// Records how a body ended.
    struct Outcome(Arc<std::sync::Mutex<Option<End>>>);

    impl Hooks for Outcome {
        fn first_data(&mut self, _: &[u8]) {}
        fn finish(self: Box<Self>, end: End, _: Usage) {
            *self.0.lock().unwrap() = Some(end);
        }
    }

    /// A body fed by a channel, with `idle` and `hooks`, that has passed one frame.
    async fn fed(
        idle: Duration,
        hooks: Box<dyn Hooks>,
    ) -> (Tracked<impl Body<Data = Bytes, Error = BoxError> + Unpin>, Feed) {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(4);
        let inner = http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        let mut body = Tracked::new(inner, idle, hooks);
        tx.send(Ok(Frame::data(Bytes::from_static(b"part")))).await.unwrap();
        body.frame().await.unwrap().unwrap();
        (body, tx)
    }

    /// [`fed`], with an idle timeout of 1 s and a record of how it ends.
    async fn fed_body()
    -> (Tracked<impl Body<Data = Bytes, Error = BoxError> + Unpin>, Feed, Arc<std::sync::Mutex<Option<End>>>)
    {
        let end = Arc::default();
        let (body, tx) = fed(Duration::from_secs(1), Box::new(Outcome(Arc::clone(&end)))).await;
        (body, tx, end)
    }

    /// The replica is judged by how its body ended: sent whole, broken off or silent past
    /// the idle timeout (its failures), or left by the client (not its doing).
    #[tokio::test(start_paused = true)]
    async fn a_body_ends_complete_failed_or_abandoned() {
        let (mut body, tx, end) = fed_body().await;
        drop(tx);
        assert!(body.frame().await.is_none());
        assert_eq!(*end.lock().unwrap(), Some(End::Complete));

        let (mut body, tx, end) = fed_body().await;
        tx.send(Err("connection reset".into())).await.unwrap();
        assert!(body.frame().await.unwrap().is_err());
        assert_eq!(*end.lock().unwrap(), Some(End::Failed));

        let (mut body, _tx, end) = fed_body().await;
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(body.frame().await.unwrap().unwrap_err().is::<IdleTimeout>());
        assert_eq!(*end.lock().unwrap(), Some(End::Failed));

        let (body, _tx, end) = fed_body().await;
        drop(body);
        assert_eq!(*end.lock().unwrap(), Some(End::Abandoned));
    }

    /// Feeds a test body.
    type Feed = tokio::sync::mpsc::Sender<Result<Frame<Bytes>, BoxError>>;

    /// A body fed by a channel, watched by a stall watch with a 1 s limit, that has passed
    /// one frame: the body, its hooks' record, the channel's sender, the watch and its count
    /// of cut bodies.
    async fn body_past_its_first_frame()
    -> (Tracked<impl Body<Data = Bytes, Error = BoxError> + Unpin>, Ending, Feed, Arc<StallWatch>, Counter)
    {
        let stalls = Counter::default();
        let watch = StallWatch::start(Duration::from_secs(1), stalls.clone());
        let ended = Ending::default();
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(4);
        let inner = http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        let mut body = Tracked::new(inner, Duration::from_secs(5), Box::new(Ended(Arc::clone(&ended))))
            .watched(watch.clone());
        tx.send(Ok(Frame::data(Bytes::from_static(b"part")))).await.unwrap();
        body.frame().await.unwrap().unwrap();
        (body, ended, tx, watch, stalls)
    }

    /// A body that handed a frame and is not asked for the next one (its client stopped
    /// reading) is cut once the limit has passed: its upstream is dropped, its load released,
    /// and hyper's next poll gets an error.
    #[tokio::test(start_paused = true)]
    async fn a_body_its_client_stopped_taking_is_cut() {
        let (mut body, ended, tx, watch, stalls) = body_past_its_first_frame().await;
        assert_eq!(watch.watching(), 1, "watched once it passed a frame");
        let handed = Instant::now();
        watch.sweep(handed + Duration::from_millis(999));
        assert_eq!(*ended.lock().unwrap(), None, "within the limit");
        watch.sweep(handed + Duration::from_millis(1_000));
        assert_eq!(*ended.lock().unwrap(), Some(None), "load released at the limit");
        assert!(tx.is_closed(), "the upstream body dropped");
        assert_eq!((stalls.get(), watch.watching()), (1, 0));
        let next = body.frame().await.unwrap();
        assert!(next.unwrap_err().is::<ClientStalled>());
        assert!(body.frame().await.is_none());
    }

    /// A body waiting on its replica is not the watch's to cut, however long it waits (its
    /// own idle timer covers that); one that ended is forgotten.
    #[tokio::test(start_paused = true)]
    async fn a_body_waiting_on_its_replica_is_not_cut() {
        let (mut body, ended, tx, watch, stalls) = body_past_its_first_frame().await;
        let waiting = futures::poll!(body.frame());
        assert!(waiting.is_pending(), "nothing more from the replica yet");
        watch.sweep(Instant::now() + Duration::from_secs(4));
        assert_eq!((*ended.lock().unwrap(), stalls.get(), watch.watching()), (None, 0, 1));
        drop(tx);
        assert!(body.frame().await.is_none());
        watch.sweep(Instant::now() + Duration::from_secs(4));
        assert_eq!((*ended.lock().unwrap(), stalls.get(), watch.watching()), (Some(None), 0, 0));
    }

    /// A watched body the client drops midway (it went away) releases its load then, though
    /// the watch still knows it; the watch forgets it at its next look.
    #[tokio::test(start_paused = true)]
    async fn a_watched_body_dropped_midway_ends_when_dropped() {
        let (body, ended, _tx, watch, stalls) = body_past_its_first_frame().await;
        assert_eq!((*ended.lock().unwrap(), watch.watching()), (None, 1));
        drop(body);
        assert_eq!(*ended.lock().unwrap(), Some(None));
        watch.sweep(Instant::now() + Duration::from_secs(4));
        assert_eq!((watch.watching(), stalls.get()), (0, 0));
    }

    /// The replica's silence is timed from when the body starts waiting on it, not from its
    /// last frame: a client that took its time over that frame does not shorten the wait.
    #[tokio::test(start_paused = true)]
    async fn the_idle_timeout_counts_from_when_the_body_waits() {
        let ended = Ending::default();
        let (mut body, tx) = fed(Duration::from_secs(5), Box::new(Ended(Arc::clone(&ended)))).await;
        tokio::time::advance(Duration::from_millis(4_500)).await;
        assert!(futures::poll!(body.frame()).is_pending(), "waiting on the replica from now");
        tokio::time::advance(Duration::from_millis(1_000)).await;
        assert!(futures::poll!(body.frame()).is_pending(), "5.5 s after the frame, 1 s into the wait");
        tokio::time::advance(Duration::from_millis(3_990)).await;
        assert!(futures::poll!(body.frame()).is_pending(), "4.99 s into the wait");
        tokio::time::advance(Duration::from_millis(10)).await;
        let failed = body.frame().await.unwrap().unwrap_err();
        assert!(failed.is::<IdleTimeout>(), "{failed}");
        assert_eq!(*ended.lock().unwrap(), Some(None));
        drop(tx);
    }

    /// An answer the router reads for itself is refused past its limit, not read whole.
    #[tokio::test]
    async fn an_answer_past_its_limit_is_refused() {
        let body = |n: usize| http_body_util::Full::new(Bytes::from(vec![b'x'; n]));
        assert_eq!(read_at_most(body(100), 100).await.unwrap().len(), 100);
        assert!(read_at_most(body(101), 100).await.is_err());
    }
}
