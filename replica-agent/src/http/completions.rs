//! OpenAI's `/v1/completions` response shapes: the `text_completion` object, whole or as
//! stream chunks.
//!
//! ```text
//! {"id","object":"text_completion","created","model",
//!  "choices":[{"index","text","logprobs":null,"finish_reason","stop_reason":null}],"usage"}
//! ```
//!
//! A stream chunk has the same keys, one choice with one token's text, `finish_reason`
//! `null` until the choice's last token, and `usage` only when the client asked for it with
//! `stream_options.include_usage` (`null` on every chunk but the final usage chunk, or with
//! `continuous_usage_stats` the choice's counts so far).

use serde::Serialize;

use super::generate::{Envelope, FINISH_REASON, Meta, UsageField, UsageJson};

/// `object` of both the response and its stream chunks.
pub(super) const OBJECT: &str = "text_completion";

#[derive(Serialize)]
struct Choice<'a> {
    index: usize,
    text: &'a str,
    logprobs: Option<()>,
    finish_reason: Option<&'static str>,
    /// What stopped it, when a stop string or token did (never here: it stops at its length).
    stop_reason: Option<()>,
}

/// The non-streaming response: one choice per prompt.
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
        .map(|(index, text)| Choice {
            index,
            text,
            logprobs: None,
            finish_reason: Some(FINISH_REASON),
            stop_reason: None,
        })
        .collect();
    Envelope::new(meta, OBJECT, choices, UsageField::Present(usage)).transfer(transfer).to_json()
}

/// One stream chunk carrying `text` for choice `index`.
pub(super) fn chunk(meta: &Meta, index: usize, text: &str, finish: bool, usage: UsageField<'_>) -> Vec<u8> {
    let choice = Choice {
        index,
        text,
        logprobs: None,
        finish_reason: finish.then_some(FINISH_REASON),
        stop_reason: None,
    };
    Envelope::new(meta, OBJECT, [choice], usage).to_json()
}
