//! OpenAI's `/v1/chat/completions` response shapes: `chat.completion` and
//! `chat.completion.chunk`.
//!
//! ```text
//! {"id","object":"chat.completion","created","model",
//!  "choices":[{"index","message":{"role":"assistant","content","refusal":null},
//!              "logprobs":null,"finish_reason","stop_reason":null}],"usage"}
//! {"id","object":"chat.completion.chunk","created","model",
//!  "choices":[{"index","delta":{"role"?,"content"?},"logprobs":null,"finish_reason",
//!              "stop_reason":null (the finishing chunk only)}]}
//! ```
//!
//! A stream opens with one chunk per choice whose delta is `{"role":"assistant",
//! "content":""}`, then one chunk per token (`{"content": token}`), the last of a choice
//! with `finish_reason`; `usage` follows the same rule as for completions.

use serde::Serialize;

use super::generate::{Envelope, FINISH_REASON, Meta, UsageField, UsageJson};

pub(super) const OBJECT: &str = "chat.completion";
pub(super) const CHUNK_OBJECT: &str = "chat.completion.chunk";
const ROLE: &str = "assistant";

#[derive(Serialize)]
struct Choice<'a> {
    index: usize,
    message: Message<'a>,
    logprobs: Option<()>,
    finish_reason: &'static str,
    /// What stopped it, when a stop string or token did (never here: it stops at its length).
    stop_reason: Option<()>,
}

#[derive(Serialize)]
struct Message<'a> {
    role: &'static str,
    content: &'a str,
    refusal: Option<()>,
}

#[derive(Serialize)]
struct ChunkChoice<'a> {
    index: usize,
    delta: Delta<'a>,
    logprobs: Option<()>,
    finish_reason: Option<&'static str>,
    /// `null` on the finishing chunk, absent before: vLLM sets it there only, and writes chat
    /// chunks without the fields it did not set.
    #[serde(skip_serializing_if = "Option::is_none")]
    stop_reason: Option<Option<()>>,
}

#[derive(Serialize)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
}

/// The non-streaming response: one choice for each of the `n` a request asks for.
/// With a prefill's answer to a remote decode, `transfer` ([`crate::kv_transfer`]).
pub(super) fn response(
    meta: &Meta,
    texts: &[String],
    usage: &UsageJson,
    transfer: Option<&serde_json::Value>,
) -> Vec<u8> {
    let choices: Vec<Choice<'_>> = texts
        .iter()
        .enumerate()
        .map(|(index, content)| Choice {
            index,
            message: Message { role: ROLE, content, refusal: None },
            logprobs: None,
            finish_reason: FINISH_REASON,
            stop_reason: None,
        })
        .collect();
    Envelope::new(meta, OBJECT, choices, UsageField::Present(usage)).transfer(transfer).to_json()
}

/// The first chunk of choice `index`: the assistant role and empty content.
pub(super) fn role_chunk(meta: &Meta, index: usize, usage: UsageField<'_>) -> Vec<u8> {
    let delta = Delta { role: Some(ROLE), content: Some("") };
    let choice = ChunkChoice { index, delta, logprobs: None, finish_reason: None, stop_reason: None };
    Envelope::new(meta, CHUNK_OBJECT, [choice], usage).to_json()
}

/// A chunk with one token of content (or, with `content` `None`, an empty delta that only
/// carries the finish reason).
pub(super) fn chunk(
    meta: &Meta,
    index: usize,
    content: Option<&str>,
    finish: bool,
    usage: UsageField<'_>,
) -> Vec<u8> {
    let delta = Delta { role: None, content };
    let choice = ChunkChoice {
        index,
        delta,
        logprobs: None,
        finish_reason: finish.then_some(FINISH_REASON),
        stop_reason: finish.then_some(None),
    };
    Envelope::new(meta, CHUNK_OBJECT, [choice], usage).to_json()
}
