//! Anthropic's `/v1/messages` response shapes, as vLLM writes them.
//!
//! ```text
//! {"id","type":"message","role":"assistant","content":[{"type":"text","text"}],"model",
//!  "stop_reason":"max_tokens","stop_sequence":null,
//!  "usage":{"input_tokens","output_tokens","cache_read_input_tokens"}}
//! ```
//!
//! `input_tokens` is the prompt less what the prefix cache served (Anthropic counts
//! `input_tokens + cache_read_input_tokens` as the prompt), as vLLM reports it.
//!
//! A stream is named events, each `event: NAME\ndata: {json}\n\n`: `message_start` (the
//! message with empty content; usage with the prompt's counts and no output yet),
//! `content_block_start` (an empty text block), one `content_block_delta` (`text_delta`) per
//! token, then `content_block_stop`, `message_delta` (the stop reason and the whole usage)
//! and `message_stop`. A failure mid-stream ends it with an `error` event.

use serde::Serialize;

use super::generate::{Meta, UsageJson};
use kvroute_proto::openai::OpenAiError;

/// Every answer stops at `max_tokens` (see `generate.rs`).
const STOP_REASON: &str = "max_tokens";

#[derive(Serialize)]
struct Message<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    role: &'static str,
    content: Vec<TextBlock<'a>>,
    model: &'a str,
    stop_reason: Option<&'static str>,
    stop_sequence: Option<()>,
    usage: Usage,
}

#[derive(Serialize)]
struct TextBlock<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    text: &'a str,
}

/// Anthropic's `usage`.
#[derive(Serialize)]
struct Usage {
    input_tokens: u64,
    output_tokens: u64,
    cache_read_input_tokens: u64,
}

impl From<&UsageJson> for Usage {
    fn from(u: &UsageJson) -> Self {
        let cached = u.prompt_tokens_details.cached_tokens;
        Usage {
            input_tokens: u.prompt_tokens.saturating_sub(cached),
            output_tokens: u.completion_tokens,
            cache_read_input_tokens: cached,
        }
    }
}

fn message<'a>(
    meta: &'a Meta,
    content: Vec<TextBlock<'a>>,
    stop: Option<&'static str>,
    usage: &UsageJson,
) -> Message<'a> {
    Message {
        id: &meta.id,
        kind: "message",
        role: "assistant",
        content,
        model: &meta.model,
        stop_reason: stop,
        stop_sequence: None,
        usage: usage.into(),
    }
}

fn json(value: &impl Serialize) -> Vec<u8> {
    // Strings, integers and options only: serializing into a Vec cannot fail.
    serde_json::to_vec(value).unwrap_or_default()
}

/// The non-streaming response (a Messages request has one prompt).
pub(super) fn response(meta: &Meta, texts: &[String], usage: &UsageJson) -> Vec<u8> {
    let text = texts.first().map_or("", String::as_str);
    json(&message(meta, vec![TextBlock { kind: "text", text }], Some(STOP_REASON), usage))
}

/// Appends `event: {name}\ndata: {json}\n\n`.
fn event(buf: &mut Vec<u8>, name: &str, json: &[u8]) {
    buf.reserve(name.len() + json.len() + 16);
    buf.extend_from_slice(b"event: ");
    buf.extend_from_slice(name.as_bytes());
    buf.extend_from_slice(b"\ndata: ");
    buf.extend_from_slice(json);
    buf.extend_from_slice(b"\n\n");
}

/// `message_start` and the text block's `content_block_start`; `usage` has the prompt's
/// counts so far.
pub(super) fn opening(meta: &Meta, usage: &UsageJson) -> Vec<u8> {
    #[derive(Serialize)]
    struct Start<'a> {
        #[serde(rename = "type")]
        kind: &'static str,
        message: Message<'a>,
    }
    let mut buf = Vec::new();
    let start = Start { kind: "message_start", message: message(meta, Vec::new(), None, usage) };
    event(&mut buf, "message_start", &json(&start));
    event(
        &mut buf,
        "content_block_start",
        br#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
    );
    buf
}

/// One token of text.
pub(super) fn delta(buf: &mut Vec<u8>, text: &str) {
    #[derive(Serialize)]
    struct Delta<'a> {
        #[serde(rename = "type")]
        kind: &'static str,
        index: usize,
        delta: TextDelta<'a>,
    }
    #[derive(Serialize)]
    struct TextDelta<'a> {
        #[serde(rename = "type")]
        kind: &'static str,
        text: &'a str,
    }
    let delta =
        Delta { kind: "content_block_delta", index: 0, delta: TextDelta { kind: "text_delta", text } };
    event(buf, "content_block_delta", &json(&delta));
}

/// The end: `content_block_stop`, `message_delta` with the whole usage, `message_stop`.
pub(super) fn closing(buf: &mut Vec<u8>, usage: &UsageJson) {
    #[derive(Serialize)]
    struct MessageDelta {
        #[serde(rename = "type")]
        kind: &'static str,
        delta: Stop,
        usage: Usage,
    }
    #[derive(Serialize)]
    struct Stop {
        stop_reason: &'static str,
        stop_sequence: Option<()>,
    }
    event(buf, "content_block_stop", br#"{"type":"content_block_stop","index":0}"#);
    let end = MessageDelta {
        kind: "message_delta",
        delta: Stop { stop_reason: STOP_REASON, stop_sequence: None },
        usage: usage.into(),
    };
    event(buf, "message_delta", &json(&end));
    event(buf, "message_stop", br#"{"type":"message_stop"}"#);
}

/// The `error` event that ends a failed stream.
pub(super) fn error(buf: &mut Vec<u8>, error: &OpenAiError) {
    event(buf, "error", &error.to_anthropic_json());
}

/// `/v1/messages/count_tokens`: `{"input_tokens": N}`.
pub(super) fn token_count(tokens: usize) -> Vec<u8> {
    format!(r#"{{"input_tokens":{tokens}}}"#).into_bytes()
}
