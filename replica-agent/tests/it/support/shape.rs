//! A strict OpenAI-shape checker: exact key sets and JSON types of every object the API
//! returns, and the ordering rules of streams. Panics with the offending JSON.
//!
//! The shapes are OpenAI's documented ones (required keys only, plus `usage` with
//! `prompt_tokens_details.cached_tokens`); vLLM-only extras would fail the check.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

/// Asserts that `v` is an object with exactly `keys`.
pub fn assert_keys(v: &Value, keys: &[&str], what: &str) {
    let object = v.as_object().unwrap_or_else(|| panic!("{what} is not an object: {v}"));
    let actual: BTreeSet<&str> = object.keys().map(String::as_str).collect();
    let expected: BTreeSet<&str> = keys.iter().copied().collect();
    assert_eq!(actual, expected, "keys of {what}: {v}");
}

fn string<'v>(v: &'v Value, what: &str) -> &'v str {
    v.as_str().unwrap_or_else(|| panic!("{what} is not a string: {v}"))
}

fn uint(v: &Value, what: &str) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("{what} is not a non-negative integer: {v}"))
}

fn null(v: &Value, what: &str) {
    assert!(v.is_null(), "{what} must be null: {v}");
}

/// OpenAI's `usage` with the realized cache hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
}

/// Checks a `usage` object.
pub fn usage(v: &Value) -> Usage {
    assert_keys(v, &["prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"], "usage");
    let prompt_tokens = uint(&v["prompt_tokens"], "usage.prompt_tokens");
    let completion_tokens = uint(&v["completion_tokens"], "usage.completion_tokens");
    assert_eq!(uint(&v["total_tokens"], "usage.total_tokens"), prompt_tokens + completion_tokens, "{v}");
    let details = &v["prompt_tokens_details"];
    assert_keys(details, &["cached_tokens"], "usage.prompt_tokens_details");
    let cached_tokens = uint(&details["cached_tokens"], "cached_tokens");
    assert!(cached_tokens <= prompt_tokens, "more cached than prompt tokens: {v}");
    Usage { prompt_tokens, completion_tokens, cached_tokens }
}

/// `id`, `object`, `created`, `model` of a response or chunk; returns them for comparison.
fn envelope(v: &Value, object: &str, id_prefix: &str) -> (String, u64, String) {
    assert_eq!(string(&v["object"], "object"), object, "{v}");
    let id = string(&v["id"], "id");
    assert!(id.starts_with(id_prefix) && id.len() > id_prefix.len(), "id {id:?} must start with {id_prefix}");
    let created = uint(&v["created"], "created");
    let model = string(&v["model"], "model");
    (id.to_owned(), created, model.to_owned())
}

fn finish_reason(v: &Value) -> Option<&str> {
    match v {
        Value::Null => None,
        Value::String(s) => {
            assert!(["stop", "length"].contains(&s.as_str()), "unknown finish_reason {s:?}");
            Some(s)
        }
        other => panic!("finish_reason must be a string or null: {other}"),
    }
}

/// A non-streaming `text_completion` with `n` choices; returns the texts and usage.
pub fn completion(v: &Value, n: usize) -> (Vec<String>, Usage) {
    let texts = choices(v, ("completion", "text_completion", "cmpl-"), n, &["text"], |c| {
        string(&c["text"], "text").to_owned()
    });
    (texts, usage(&v["usage"]))
}

/// A non-streaming `chat.completion`; returns the content and usage.
pub fn chat_completion(v: &Value) -> (String, Usage) {
    let (mut contents, usage) = chat_completion_n(v, 1);
    (contents.remove(0), usage)
}

/// A non-streaming `chat.completion` with `n` choices; returns their contents and the usage.
pub fn chat_completion_n(v: &Value, n: usize) -> (Vec<String>, Usage) {
    let contents = choices(v, ("chat completion", "chat.completion", "chatcmpl-"), n, &["message"], |c| {
        let m = &c["message"];
        assert_keys(m, &["role", "content", "refusal"], "message");
        assert_eq!(string(&m["role"], "role"), "assistant");
        null(&m["refusal"], "refusal");
        string(&m["content"], "content").to_owned()
    });
    (contents, usage(&v["usage"]))
}

/// The `n` choices of a non-streaming response `v` (`what`, its `object` and id prefix):
/// its keys and envelope checked, and each choice's keys (`index`, `logprobs`,
/// `finish_reason` and `own`), index, null logprobs and finish reason, then `read`.
fn choices<T>(
    v: &Value,
    (what, object, id_prefix): (&str, &str, &str),
    n: usize,
    own: &[&str],
    read: impl Fn(&Value) -> T,
) -> Vec<T> {
    assert_keys(v, &["id", "object", "created", "model", "choices", "usage"], what);
    envelope(v, object, id_prefix);
    let choices = v["choices"].as_array().expect("choices is an array");
    assert_eq!(choices.len(), n, "{v}");
    let keys: Vec<&str> =
        ["index", "logprobs", "finish_reason", "stop_reason"].iter().chain(own).copied().collect();
    choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            assert_keys(c, &keys, &format!("{what} choice"));
            assert_eq!(uint(&c["index"], "index"), i as u64);
            null(&c["logprobs"], "logprobs");
            null(&c["stop_reason"], "stop_reason");
            assert!(
                finish_reason(&c["finish_reason"]).is_some(),
                "a finished choice has a finish_reason: {c}"
            );
            read(c)
        })
        .collect()
}

/// Checks the frame-independent rules of a stream and parses its chunks: the last event is
/// `[DONE]`, every other one is a JSON chunk with one `id`/`created`/`model`, and `usage`
/// is absent without `include_usage`, else `null` on every chunk but the last, which has
/// `choices: []` and the usage.
fn stream_chunks(
    events: &[String],
    object: &str,
    id_prefix: &str,
    include_usage: bool,
) -> (Vec<Value>, Option<Usage>) {
    let (last, chunks) = events.split_last().expect("at least one event");
    assert_eq!(last, "[DONE]", "a stream ends with [DONE]");
    let mut chunks: Vec<Value> =
        chunks.iter().map(|e| serde_json::from_str(e).unwrap_or_else(|err| panic!("{err}: {e}"))).collect();
    let mut first = None;
    for c in &chunks {
        let keys: &[&str] = if include_usage {
            &["id", "object", "created", "model", "choices", "usage"]
        } else {
            &["id", "object", "created", "model", "choices"]
        };
        assert_keys(c, keys, "stream chunk");
        let env = envelope(c, object, id_prefix);
        assert_eq!(
            first.get_or_insert_with(|| env.clone()),
            &env,
            "every chunk has the same id, created, model"
        );
    }
    let usage = include_usage.then(|| {
        let last = chunks.pop().expect("a usage chunk");
        assert_eq!(last["choices"], Value::Array(vec![]), "the usage chunk has no choices: {last}");
        usage(&last["usage"])
    });
    for c in &chunks {
        if include_usage {
            null(&c["usage"], "usage of a content chunk");
        }
        assert_eq!(c["choices"].as_array().map(Vec::len), Some(1), "one choice per chunk: {c}");
    }
    (chunks, usage)
}

/// Per-choice ordering: nothing after a choice's finish_reason, and every choice finishes.
fn check_finish_order(finished: &mut BTreeMap<u64, bool>, index: u64, finish: Option<&str>, c: &Value) {
    let done = finished.entry(index).or_insert(false);
    assert!(!*done, "chunk after the finish_reason of choice {index}: {c}");
    *done = finish.is_some();
}

/// A `text_completion` stream with `n` choices; returns each choice's text and the usage
/// (present iff `include_usage`).
pub fn completion_stream(events: &[String], n: usize, include_usage: bool) -> (Vec<String>, Option<Usage>) {
    let (chunks, usage) = stream_chunks(events, "text_completion", "cmpl-", include_usage);
    let mut texts = vec![String::new(); n];
    let mut finished = BTreeMap::new();
    for c in &chunks {
        let choice = &c["choices"][0];
        assert_keys(
            choice,
            &["index", "text", "logprobs", "finish_reason", "stop_reason"],
            "completion chunk choice",
        );
        null(&choice["stop_reason"], "stop_reason");
        let index = uint(&choice["index"], "index");
        assert!((index as usize) < n, "choice index {index} out of range: {c}");
        null(&choice["logprobs"], "logprobs");
        check_finish_order(&mut finished, index, finish_reason(&choice["finish_reason"]), c);
        texts[index as usize].push_str(string(&choice["text"], "text"));
    }
    assert_eq!(finished.len(), n, "every choice streams");
    assert!(finished.values().all(|f| *f), "every choice ends with a finish_reason");
    (texts, usage)
}

/// A `chat.completion.chunk` stream; returns the content and the usage.
pub fn chat_stream(events: &[String], include_usage: bool) -> (String, Option<Usage>) {
    let (mut contents, usage) = chat_stream_n(events, 1, include_usage);
    (contents.remove(0), usage)
}

/// A `chat.completion.chunk` stream of `n` choices, which opens with each one's role chunk
/// in turn (as vLLM's does); returns their contents and the usage.
pub fn chat_stream_n(events: &[String], n: usize, include_usage: bool) -> (Vec<String>, Option<Usage>) {
    let (chunks, usage) = stream_chunks(events, "chat.completion.chunk", "chatcmpl-", include_usage);
    let mut contents = vec![String::new(); n];
    let mut finished = BTreeMap::new();
    for (i, c) in chunks.iter().enumerate() {
        let choice = &c["choices"][0];
        let finish = finish_reason(&choice["finish_reason"]);
        // vLLM writes chat chunks without the fields it did not set: `stop_reason` is set on
        // the finishing chunk only.
        let keys: &[&str] = match finish {
            Some(_) => &["index", "delta", "logprobs", "finish_reason", "stop_reason"],
            None => &["index", "delta", "logprobs", "finish_reason"],
        };
        assert_keys(choice, keys, "chat chunk choice");
        let index = uint(&choice["index"], "index");
        assert!((index as usize) < n, "choice index {index} out of range: {c}");
        null(&choice["logprobs"], "logprobs");
        let delta = &choice["delta"];
        if i < n {
            assert_eq!(index, i as u64, "the role chunks come first, in order: {c}");
            assert_keys(delta, &["role", "content"], "first delta");
            assert_eq!(delta["role"], "assistant");
            assert_eq!(delta["content"], "");
            assert!(finish.is_none(), "the role chunk does not finish: {c}");
        } else if finish.is_some() && delta.as_object().is_some_and(|d| d.is_empty()) {
            // An empty delta may carry only the finish reason.
        } else {
            assert_keys(delta, &["content"], "content delta");
            contents[index as usize].push_str(string(&delta["content"], "content"));
        }
        check_finish_order(&mut finished, index, finish, c);
    }
    assert_eq!(finished.len(), n, "every choice streams");
    assert!(finished.values().all(|f| *f), "every choice ends with a finish_reason");
    (contents, usage)
}

/// An OpenAI error body; returns `(type, param, code)`.
pub fn error(v: &Value) -> (String, Option<String>, Option<String>) {
    assert_keys(v, &["error"], "error response");
    let e = &v["error"];
    assert_keys(e, &["message", "type", "param", "code"], "error");
    assert!(!string(&e["message"], "message").is_empty());
    let opt = |x: &Value, what| match x {
        Value::Null => None,
        other => Some(string(other, what).to_owned()),
    };
    (string(&e["type"], "type").to_owned(), opt(&e["param"], "param"), opt(&e["code"], "code"))
}
