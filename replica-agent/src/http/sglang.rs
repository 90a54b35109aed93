//! SGLang's native `POST /generate` answers (`tokenizer_manager._handle_batch_output` and
//! `http_server.generate_request`, 2026):
//!
//! ```text
//! {"text","output_ids","meta_info":{"id","finish_reason":{"type":"length","length"},
//!  "prompt_tokens","completion_tokens","cached_tokens","e2e_latency"}}
//! ```
//!
//! A request of several prompts or choices (`n`) is answered with a list of those, each
//! prompt's choices in turn, their ids the request's with `_0`, `_1`, ... appended. A stream
//! sends the same object as each token comes: its choice's `text` and `output_ids` so far
//! (SGLang's default; not `--incremental-streaming-output`), its counts so far,
//! `finish_reason` null until its choice's last chunk (which alone has `e2e_latency`) and, in a
//! request of several, the choice's `index`; then `data: [DONE]`. `output_ids` are the
//! simulated words' places in the agent's word list. The request's id is its `rid` if it names
//! one, else the agent's request id.

use std::borrow::Cow;
use std::time::Instant;

use serde::Serialize;

use crate::engine::{Usage, token_id};

#[derive(Serialize)]
struct Answer<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    index: Option<usize>,
    text: &'a str,
    output_ids: &'a [u32],
    meta_info: MetaInfo<'a>,
}

#[derive(Serialize)]
struct MetaInfo<'a> {
    id: Cow<'a, str>,
    finish_reason: Option<FinishReason>,
    prompt_tokens: u32,
    completion_tokens: u32,
    cached_tokens: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    e2e_latency: Option<f64>,
}

/// Why a choice ended: the simulated engine stops at its length only.
#[derive(Serialize)]
struct FinishReason {
    #[serde(rename = "type")]
    kind: &'static str,
    length: u32,
}

/// One choice's output so far.
#[derive(Debug, Default)]
pub(super) struct Output {
    pub text: String,
    pub ids: Vec<u32>,
}

impl Output {
    pub fn push(&mut self, token: &str) {
        self.text.push_str(token);
        self.ids.push(token_id(token));
    }
}

/// How a request's choices are named: its id, and whether it is answered with a list (a batch,
/// of one prompt too, or several choices).
#[derive(Clone, Copy, Debug)]
pub(super) struct Naming<'a> {
    pub id: &'a str,
    pub several: bool,
}

/// A stream's progress: each choice's output so far, whether the request has several (a
/// batch, or `n`), and when it came.
#[derive(Debug)]
pub(super) struct Streaming {
    pub outputs: Vec<Output>,
    pub several: bool,
    pub started: Instant,
}

impl Streaming {
    pub fn new(choices: usize, several: bool, started: Instant) -> Self {
        Streaming { outputs: (0..choices).map(|_| Output::default()).collect(), several, started }
    }
}

/// A choice's answer so far: the `index`th of `naming`'s request, with its output and usage,
/// done (at `ended`) or not, for a request `started` then.
struct Choice<'a> {
    naming: Naming<'a>,
    index: usize,
    output: &'a Output,
    usage: &'a Usage,
    ended: Option<Instant>,
    started: Instant,
}

impl Choice<'_> {
    /// As SGLang writes it; with its `index` (a stream's chunk of a request of several) if
    /// `indexed`.
    fn to_json(&self, indexed: bool) -> Vec<u8> {
        let (naming, index, usage) = (self.naming, self.index, self.usage);
        let id = match naming.several {
            true => Cow::Owned(format!("{}_{index}", naming.id)),
            false => Cow::Borrowed(naming.id),
        };
        let answer = Answer {
            index: indexed.then_some(index),
            text: &self.output.text,
            output_ids: &self.output.ids,
            meta_info: MetaInfo {
                id,
                finish_reason: self
                    .ended
                    .map(|_| FinishReason { kind: "length", length: usage.completion_tokens }),
                prompt_tokens: usage.prompt_tokens,
                completion_tokens: usage.completion_tokens,
                cached_tokens: usage.cached_tokens,
                e2e_latency: self.ended.map(|ended| ended.duration_since(self.started).as_secs_f64()),
            },
        };
        // Strings, integers and floats only: serializing into a Vec cannot fail.
        serde_json::to_vec(&answer).unwrap_or_default()
    }
}

/// The whole answer to a request `started` then: one object, or a list of several.
pub(super) fn response(naming: Naming<'_>, choices: &[(Output, Usage)], started: Instant) -> Vec<u8> {
    let ended = Some(Instant::now());
    let mut answers = choices.iter().enumerate().map(|(index, (output, usage))| {
        Choice { naming, index, output, usage, ended, started }.to_json(false)
    });
    if !naming.several {
        return answers.next().unwrap_or_default();
    }
    let mut list = b"[".to_vec();
    for (i, answer) in answers.enumerate() {
        if i > 0 {
            list.push(b',');
        }
        list.extend(answer);
    }
    list.push(b']');
    list
}

/// A stream's chunk for choice `index` of a request `started` then: its output so far, done
/// if `done`.
pub(super) fn chunk(
    naming: Naming<'_>,
    index: usize,
    (output, usage): (&Output, &Usage),
    done: bool,
    started: Instant,
) -> Vec<u8> {
    let ended = done.then(Instant::now);
    Choice { naming, index, output, usage, ended, started }.to_json(naming.several)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn output(words: &[&str]) -> Output {
        let mut output = Output::default();
        words.iter().for_each(|w| output.push(w));
        output
    }

    #[test]
    fn one_choice_is_an_object_and_several_a_list() {
        let usage = Usage { prompt_tokens: 10, completion_tokens: 2, cached_tokens: 8 };
        let started = Instant::now();
        let one =
            response(Naming { id: "r", several: false }, &[(output(&[" the", " cache"]), usage)], started);
        let one: serde_json::Value = serde_json::from_slice(&one).unwrap();
        assert_eq!(one["text"], " the cache");
        assert_eq!(one["output_ids"], serde_json::json!([0, 1]));
        let meta = &one["meta_info"];
        assert_eq!((meta["id"].as_str(), meta["cached_tokens"].as_u64()), (Some("r"), Some(8)));
        assert_eq!(meta["finish_reason"], serde_json::json!({"type": "length", "length": 2}));
        assert!(meta["e2e_latency"].is_f64());
        assert_eq!(one.get("index"), None);
        let choices = [(output(&[" the"]), usage), (output(&[" block"]), usage)];
        let several = response(Naming { id: "r", several: true }, &choices, started);
        let several: Vec<serde_json::Value> = serde_json::from_slice(&several).unwrap();
        let ids: Vec<_> = several.iter().map(|a| a["meta_info"]["id"].as_str().unwrap()).collect();
        assert_eq!(ids, ["r_0", "r_1"]);
        assert_eq!((several[1]["text"].as_str(), several[1].get("index")), (Some(" block"), None));
    }

    #[test]
    fn a_chunk_says_its_choice_and_ends_only_when_done() {
        let usage = Usage { prompt_tokens: 10, completion_tokens: 1, cached_tokens: 0 };
        let naming = Naming { id: "r", several: true };
        let chunk = |done| -> serde_json::Value {
            let fleet = output(&[" fleet"]);
            serde_json::from_slice(&chunk(naming, 1, (&fleet, &usage), done, Instant::now())).unwrap()
        };
        let going = chunk(false);
        assert_eq!(
            (going["index"].as_u64(), &going["meta_info"]["finish_reason"]),
            (Some(1), &serde_json::Value::Null)
        );
        assert_eq!(going["meta_info"].get("e2e_latency"), None);
        assert_eq!(chunk(true)["meta_info"]["finish_reason"]["type"], "length");
    }
}
