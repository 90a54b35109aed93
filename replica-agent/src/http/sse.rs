//! Server-sent events for `stream: true`: a response body that turns the engine's output
//! channels into `data: {json}\n\n` frames as the tokens arrive, never buffering them.
//!
//! The body is a stream over the engine's own bounded channels (one per prompt, merged), so
//! hyper pulls a frame only when the engine has produced one and writes it out at once; a
//! client that goes away drops the body, which drops the channels, which makes the engine
//! abort the requests and unpin their blocks.
//!
//! Frame order, as OpenAI and vLLM send it:
//! 1. chat only: one `delta: {"role":"assistant","content":""}` chunk per choice, with the
//!    first token (vLLM sends it when the engine's first output comes, after the prefill:
//!    a stream's first event tells its time to first token);
//! 2. one chunk per token, the last token of a choice with `finish_reason: "length"` (if the
//!    engine finishes a choice short of `max_tokens`, an empty chunk carries the reason);
//! 3. with `stream_options.include_usage`, a chunk with `choices: []` and the `usage`
//!    (every earlier chunk then has `"usage": null`, or with `continuous_usage_stats` its
//!    choice's usage so far: its prompt's tokens and the tokens it has generated, without
//!    `prompt_tokens_details`, as vLLM writes it);
//!    clients that need `cached_tokens` from a stream, like kvroute's router and load
//!    generator, must set it;
//! 4. `data: [DONE]`.
//!
//! A `/v1/messages` stream is Anthropic's named events instead (`messages.rs`); a `/generate`
//! stream (SGLang's) sends each choice's answer so far with every token (`sglang.rs`), then
//! `data: [DONE]`.
//!
//! If the engine fails a request mid-stream, the body ends with one
//! `data: {"error":{...}}` event and then `data: [DONE]`, as vLLM 0.33 ends a stream it
//! fails; the error event is what tells a client the answer is incomplete.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::stream::{self, SelectAll, Stream, StreamExt};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use tokio::sync::mpsc;

use super::Body;
use super::error::ApiError;
use super::generate::{Admitted, Api, Envelope, Meta, StreamUsage, Tally, UsageField, UsageJson};
use super::{chat, completions, messages, responses, sglang};
use crate::engine::{Output, Usage};

/// The SSE body of a streamed generation whose choices have all been admitted, with what
/// its chunks say of the usage and how the usage is counted.
pub(super) fn body(
    api: Api,
    meta: Meta,
    admitted: Vec<Admitted>,
    (usage, tally): (StreamUsage, Tally),
    (mut responses, native): (Option<responses::Streaming>, Option<sglang::Streaming>),
) -> Body {
    let (mut opening, mut first) = (Vec::new(), Vec::new());
    match api {
        Api::Chat => {
            for (index, a) in admitted.iter().enumerate() {
                let so_far = usage.continuous.then(|| usage_so_far((a.prompt_tokens, a.cached_tokens), 0));
                event(&mut first, &chat::role_chunk(&meta, index, chunk_usage(usage, so_far.as_ref())));
            }
        }
        Api::Messages => {
            let mut usage = UsageJson::default();
            for a in &admitted {
                usage.prompt_tokens += u64::from(a.prompt_tokens);
                usage.prompt_tokens_details.cached_tokens += u64::from(a.cached_tokens);
            }
            first = messages::opening(&meta, &usage);
        }
        Api::Responses => {
            if let Some(r) = &mut responses {
                opening = responses::opening(&meta, r.previous.as_deref(), &mut r.sequence);
            }
        }
        Api::Completions | Api::Native => {}
    }
    let state = State {
        api,
        usage,
        opening: (!opening.is_empty()).then(|| Bytes::from(opening)),
        first: (!first.is_empty()).then_some(first),
        begun: false,
        generated: vec![0; admitted.len()],
        max_tokens: admitted.iter().map(|a| a.max_tokens).collect(),
        finished: vec![false; admitted.len()],
        remaining: admitted.len(),
        tally,
        prompt: admitted.iter().map(|a| (a.prompt_tokens, a.cached_tokens)).collect(),
        outputs: admitted.into_iter().enumerate().map(|(index, a)| Tagged { index, rx: a.rx }).collect(),
        meta,
        done: false,
        responses,
        native,
    };
    StreamBody::new(stream::unfold(state, next_frame)).boxed_unsync()
}

/// The progress of one streamed response.
struct State {
    api: Api,
    meta: Meta,
    usage: StreamUsage,
    /// Frames to send at once, before the engine's first output (a Responses stream's
    /// `response.created` and `response.in_progress`).
    opening: Option<Bytes>,
    /// Frames to send with the engine's first token, as vLLM sends them once its engine has
    /// produced one (the chat role chunks, Anthropic's `message_start`; a Responses stream's
    /// item is numbered then, [`output_begins`]).
    first: Option<Vec<u8>>,
    /// The engine's first output has come.
    begun: bool,
    /// Every prompt's engine outputs, tagged with the prompt's index.
    outputs: SelectAll<Tagged>,
    generated: Vec<u32>,
    max_tokens: Vec<u32>,
    /// Whether a choice's `finish_reason` chunk has been sent.
    finished: Vec<bool>,
    /// Choices whose `Done` has not arrived yet.
    remaining: usize,
    tally: Tally,
    /// Each choice's prompt tokens and how many of them were cached.
    prompt: Vec<(u32, u32)>,
    done: bool,
    /// A Responses API stream's own progress.
    responses: Option<responses::Streaming>,
    /// An SGLang `/generate` stream's own progress.
    native: Option<sglang::Streaming>,
}

async fn next_frame(mut s: State) -> Option<(Result<Frame<Bytes>, Infallible>, State)> {
    if let Some(opening) = s.opening.take() {
        return Some((Ok(Frame::data(opening)), s));
    }
    let mut buf = Vec::new();
    while buf.is_empty() && !s.done {
        match s.outputs.next().await {
            Some((i, Output::Token(text))) => {
                output_begins(&mut buf, &mut s);
                s.tally.output(i, s.prompt[i].0, s.prompt[i].1);
                s.generated[i] += 1;
                let last = s.generated[i] >= s.max_tokens[i] && !s.finished[i];
                s.finished[i] |= last;
                let so_far = s.usage.continuous.then(|| usage_so_far(s.prompt[i], s.generated[i]));
                let chunk_usage = chunk_usage(s.usage, so_far.as_ref());
                match (s.api, &mut s.responses, &mut s.native) {
                    (Api::Messages, ..) => messages::delta(&mut buf, text),
                    (Api::Responses, Some(r), _) => {
                        r.text.push_str(text);
                        responses::delta(&mut buf, &s.meta, text, &mut r.sequence);
                    }
                    (Api::Native, _, Some(native)) => {
                        native.outputs[i].push(text);
                        event(&mut buf, &native_chunk(&s, i, last));
                    }
                    (api, ..) => {
                        event(&mut buf, &token_chunk(api, &s.meta, i, Some(text), last, chunk_usage))
                    }
                }
            }
            Some((i, Output::Done(usage))) => {
                output_begins(&mut buf, &mut s);
                s.tally.done(i, &usage);
                s.remaining = s.remaining.saturating_sub(1);
                let named = matches!(s.api, Api::Messages | Api::Responses);
                if !s.finished[i] && s.native.is_some() {
                    s.finished[i] = true;
                    event(&mut buf, &native_chunk(&s, i, true));
                } else if !s.finished[i] && !named {
                    s.finished[i] = true;
                    let so_far = s.usage.continuous.then(|| usage_so_far(s.prompt[i], s.generated[i]));
                    let chunk_usage = chunk_usage(s.usage, so_far.as_ref());
                    event(&mut buf, &token_chunk(s.api, &s.meta, i, None, true, chunk_usage));
                }
                if s.remaining == 0 && s.api == Api::Messages {
                    messages::closing(&mut buf, &s.tally.usage());
                    s.done = true;
                } else if s.remaining == 0
                    && let Some(r) = s.responses.as_mut()
                {
                    let previous = r.previous.as_deref();
                    let usage = s.tally.usage();
                    responses::closing(&mut buf, &s.meta, (&r.text, &usage), previous, &mut r.sequence);
                    if let Some(keep) = r.keep.take() {
                        keep.store(&s.meta, &r.text, &usage);
                    }
                    s.done = true;
                } else if s.remaining == 0 {
                    if s.usage.include {
                        event(&mut buf, &usage_chunk(s.api, &s.meta, &s.tally.usage()));
                    }
                    buf.extend_from_slice(b"data: [DONE]\n\n");
                    s.done = true;
                }
            }
            Some((_, Output::Started { .. })) => {}
            Some((_, Output::Failed(why))) => {
                failed(&mut buf, &mut s, &ApiError::engine_failed(why));
                s.done = true;
            }
            None => {
                let why = "the engine stopped before finishing the request";
                failed(&mut buf, &mut s, &ApiError::engine_failed(why));
                s.done = true;
            }
        }
    }
    if buf.is_empty() {
        return None;
    }
    Some((Ok(Frame::data(Bytes::from(buf))), s))
}

/// The engine's first output (a token, or a choice's end) is here: the frames that open the
/// output go first, once. (A stream failed before it sends none of them, as vLLM's: a
/// Responses stream's numbers go on from its opening events.)
fn output_begins(buf: &mut Vec<u8>, s: &mut State) {
    if std::mem::replace(&mut s.begun, true) {
        return;
    }
    buf.extend(s.first.take().unwrap_or_default());
    if let Some(r) = s.responses.as_mut() {
        responses::output_opened(buf, &s.meta, &mut r.sequence);
    }
}

/// The events that end a failed stream.
fn failed(buf: &mut Vec<u8>, s: &mut State, error: &ApiError) {
    match (s.api, &mut s.responses) {
        (Api::Messages, _) => messages::error(buf, &error.error),
        (Api::Responses, Some(r)) => responses::error(buf, &error.error, &mut r.sequence),
        _ => {
            event(buf, &error.error.to_json());
            buf.extend_from_slice(b"data: [DONE]\n\n");
        }
    }
}

/// Appends `data: {json}\n\n`.
fn event(buf: &mut Vec<u8>, json: &[u8]) {
    buf.reserve(json.len() + 8);
    buf.extend_from_slice(b"data: ");
    buf.extend_from_slice(json);
    buf.extend_from_slice(b"\n\n");
}

/// A token chunk (or, with `text` `None`, the empty chunk that only carries the finish
/// reason) in `api`'s shape.
fn token_chunk(
    api: Api,
    meta: &Meta,
    index: usize,
    text: Option<&str>,
    finish: bool,
    usage: UsageField<'_>,
) -> Vec<u8> {
    match api {
        Api::Completions => completions::chunk(meta, index, text.unwrap_or(""), finish, usage),
        Api::Chat | Api::Messages | Api::Responses | Api::Native => {
            chat::chunk(meta, index, text, finish, usage)
        }
    }
}

/// An SGLang `/generate` stream's chunk for choice `i`: its output and counts so far.
fn native_chunk(s: &State, i: usize, done: bool) -> Vec<u8> {
    let Some(native) = &s.native else { return Vec::new() };
    let (prompt_tokens, cached_tokens) = s.prompt[i];
    let usage = Usage { prompt_tokens, completion_tokens: s.generated[i], cached_tokens };
    let naming = sglang::Naming { id: &s.meta.id, several: native.several };
    sglang::chunk(naming, i, (&native.outputs[i], &usage), done, native.started)
}

/// The `usage` of a chunk: its choice's usage so far (`so_far`) with `continuous_usage_stats`,
/// else `null` with `include_usage`, else none.
fn chunk_usage(usage: StreamUsage, so_far: Option<&UsageJson>) -> UsageField<'_> {
    match so_far {
        Some(so_far) => UsageField::SoFar(so_far),
        None => UsageField::for_chunks(usage.include),
    }
}

/// A choice's usage so far, as `continuous_usage_stats` reports it: its prompt's tokens and
/// the tokens it has generated (written without the cached tokens: [`UsageField::SoFar`]).
fn usage_so_far((prompt_tokens, _): (u32, u32), generated: u32) -> UsageJson {
    let (prompt_tokens, completion_tokens) = (u64::from(prompt_tokens), u64::from(generated));
    UsageJson {
        prompt_tokens,
        completion_tokens,
        total_tokens: prompt_tokens + completion_tokens,
        ..Default::default()
    }
}

/// The final `choices: []` chunk carrying the usage of the whole request.
fn usage_chunk(api: Api, meta: &Meta, usage: &UsageJson) -> Vec<u8> {
    let object = match api {
        Api::Completions => completions::OBJECT,
        Api::Chat | Api::Messages | Api::Responses | Api::Native => chat::CHUNK_OBJECT,
    };
    Envelope::new(meta, object, [(); 0], UsageField::Present(usage)).to_json()
}

/// One prompt's engine outputs, tagged with the prompt's index in the request.
struct Tagged {
    index: usize,
    rx: mpsc::Receiver<Output>,
}

impl Stream for Tagged {
    type Item = (usize, Output);

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let index = this.index;
        this.rx.poll_recv(cx).map(|o| o.map(|o| (index, o)))
    }
}
