//! SGLang's native `POST /generate`, read as the completion request it amounts to: the
//! router routes it on that request's prompt, and the replica agent serves it so
//! (`sglang/srt/managers/io_struct.py`'s `GenerateReqInput`, 2026).
//!
//! | `/generate` | the completion's |
//! |---|---|
//! | `input_ids` (one id list, or a batch of them), else `text` (a string or a batch) | `prompt`: SGLang tokenizes `text` with the tokenizer's special tokens, as a completion's prompt is (no chat template) |
//! | `input_embeds`, with neither | `prompt_embeds` (one a prompt: counted only): no token ids to route on |
//! | `sampling_params.max_new_tokens` (128 when absent or null; of a list of them, one a prompt, the largest) | `max_tokens` |
//! | `sampling_params.n` (of a list, the first's: SGLang asks them all to be equal) | `n` |
//! | `lora_path` (an adapter's name; of a list, one a prompt, the name they all give) | `model` (none: the base model) |
//! | `stream`, `priority`, `cache_salt` | as they are |
//!
//! Everything else is SGLang's to read. The body sent to a replica is the client's, as it
//! was. What is read is checked as the completion's fields are, each error naming the
//! `/generate` field at fault where it is one of its own.

use serde::Serialize;
use serde_json::Value;
use serde_json::value::RawValue;

use super::{RequestError, lax_integer, parse_object};

/// The path SGLang serves it at.
pub const GENERATE_PATH: &str = "/generate";

/// SGLang's `max_new_tokens` when a request sets none.
pub const DEFAULT_MAX_NEW_TOKENS: u64 = 128;

/// The fields read, in [`completion_body`]'s order.
const FIELDS: [&str; 8] =
    ["text", "input_ids", "input_embeds", "sampling_params", "stream", "lora_path", "priority", "cache_salt"];

/// The completion request a `/generate` body amounts to (module docs), as JSON.
#[derive(Serialize)]
struct Completion<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    model: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_embeds: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream: Option<&'a RawValue>,
    max_tokens: u64,
    n: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    priority: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_salt: Option<String>,
}

/// The completion request `body`, a `/generate` request, amounts to (module docs).
pub fn completion_body(body: &[u8]) -> Result<Vec<u8>, RequestError> {
    let [text, ids, embeds, sampling, stream, lora, priority, salt] = parse_object(body, &FIELDS)?;
    let [text, ids, embeds, sampling, lora, salt] = [text, ids, embeds, sampling, lora, salt].map(given);
    let (prompt, prompt_embeds) = match (text, ids, embeds) {
        (Some(_), Some(_), Some(_)) | (None, None, None) => return Err(RequestError::NoGenerateInput),
        (_, Some(ids), _) => (Some(ids_of(ids)?), None),
        (Some(text), None, _) => (Some(text_of(text)?), None),
        (None, None, Some(embeds)) => (None, Some(embeds_as_prompts(embeds))),
    };
    let (max_tokens, n) = sampling_params(sampling)?;
    let adapter = adapter(lora)?;
    let completion = Completion {
        model: adapter.as_deref(),
        prompt,
        prompt_embeds,
        stream,
        max_tokens,
        n,
        priority,
        cache_salt: cache_salt(salt)?,
    };
    serde_json::to_vec(&completion).map_err(RequestError::Json)
}

/// SGLang's `input_embeds` as vLLM's `prompt_embeds` counts prompts (one a list element): a
/// prompt's (a vector a token, `[[f32]]`) is one, a batch's (`[[[f32]]]`) one a prompt. Only
/// counted: the replica is sent the client's body. (Each vector was counted a sequence.)
fn embeds_as_prompts(embeds: &RawValue) -> Value {
    fn list(raw: &RawValue) -> Option<Vec<&RawValue>> {
        serde_json::from_str(raw.get()).ok()
    }
    let nested = |raw: &&RawValue| raw.get().trim_start().starts_with('[');
    match list(embeds) {
        // A batch: its prompts' vectors are lists.
        Some(prompts)
            if prompts.first().and_then(|p| list(p)).is_some_and(|p| p.first().is_some_and(nested)) =>
        {
            Value::Array(vec![Value::Null; prompts.len()])
        }
        _ => Value::String(String::new()),
    }
}

/// `raw` unless it is null.
fn given(raw: Option<&RawValue>) -> Option<&RawValue> {
    raw.filter(|raw| raw.get() != "null")
}

/// `input_ids`: a non-empty list (what is in it, the completion's prompt checks).
fn ids_of(raw: &RawValue) -> Result<&RawValue, RequestError> {
    const EXPECTED: &str = "a list of token ids or a list of such lists";
    let list: Vec<&RawValue> = serde_json::from_str(raw.get())
        .map_err(|_| RequestError::InvalidField { param: "input_ids", expected: EXPECTED })?;
    match list.is_empty() {
        true => Err(RequestError::InvalidField { param: "input_ids", expected: "a non-empty list" }),
        false => Ok(raw),
    }
}

/// `text`: a string, or a non-empty list of them (a batch).
fn text_of(raw: &RawValue) -> Result<&RawValue, RequestError> {
    const EXPECTED: &str = "a string or a list of strings";
    let invalid = || RequestError::InvalidField { param: "text", expected: EXPECTED };
    if raw.get().starts_with('"') {
        return Ok(raw);
    }
    let texts: Vec<&RawValue> = serde_json::from_str(raw.get()).map_err(|_| invalid())?;
    if texts.is_empty() {
        return Err(RequestError::InvalidField { param: "text", expected: "a non-empty list" });
    }
    match texts.iter().all(|text| text.get().starts_with('"')) {
        true => Ok(raw),
        false => Err(invalid()),
    }
}

/// `cache_salt`: a string (empty: none, as SGLang reads it), or a list of them, one a prompt,
/// of which the first prompt's is the one its prefix is predicted in (the router's
/// prediction is the first prompt's; kvroute's agent salts every prompt with it).
fn cache_salt(raw: Option<&RawValue>) -> Result<Option<String>, RequestError> {
    const EXPECTED: &str = "a string or a list of strings";
    let invalid = || RequestError::InvalidField { param: "cache_salt", expected: EXPECTED };
    let Some(raw) = raw else { return Ok(None) };
    let salt = match serde_json::from_str::<Value>(raw.get()).map_err(|_| invalid())? {
        Value::String(salt) => Some(salt),
        Value::Array(salts) => match salts.into_iter().next() {
            Some(Value::String(salt)) => Some(salt),
            Some(Value::Null) | None => None,
            Some(_) => return Err(invalid()),
        },
        _ => return Err(invalid()),
    };
    Ok(salt.filter(|salt| !salt.is_empty()))
}

/// `max_new_tokens` and `n` of `sampling_params`: an object, or a list of them (one a prompt).
fn sampling_params(raw: Option<&RawValue>) -> Result<(u64, u64), RequestError> {
    const EXPECTED: &str = "an object or a list of objects";
    let invalid = || RequestError::InvalidField { param: "sampling_params", expected: EXPECTED };
    let Some(raw) = raw else { return Ok((DEFAULT_MAX_NEW_TOKENS, 1)) };
    let params: Vec<Option<&RawValue>> = match raw.get().starts_with('[') {
        true => serde_json::from_str(raw.get()).map_err(|_| invalid())?,
        false => vec![Some(raw)],
    };
    let mut read = Vec::with_capacity(params.len());
    for params in params {
        let (max_new_tokens, n) = read_params(given(params)).map_err(|e| e.unwrap_or_else(invalid))?;
        read.push((max_new_tokens.unwrap_or(DEFAULT_MAX_NEW_TOKENS), n.unwrap_or(1)));
    }
    let max_tokens = read.iter().map(|(max, _)| *max).max().unwrap_or(DEFAULT_MAX_NEW_TOKENS);
    let n = read.first().map_or(1, |(_, n)| *n);
    Ok((max_tokens, n))
}

/// A prompt's `max_new_tokens`, if its sampling params (one object of `sampling_params`, or
/// none) set it.
pub fn max_new_tokens(params: Option<&RawValue>) -> Result<Option<u64>, RequestError> {
    const EXPECTED: &str = "an object or a list of objects";
    let invalid = || RequestError::InvalidField { param: "sampling_params", expected: EXPECTED };
    Ok(read_params(given(params)).map_err(|e| e.unwrap_or_else(invalid))?.0)
}

/// `max_new_tokens` and `n` of one object of `sampling_params`; `Err(None)` if it is no object.
fn read_params(params: Option<&RawValue>) -> Result<(Option<u64>, Option<u64>), Option<RequestError>> {
    let [max_new_tokens, n] = match params {
        Some(p) => parse_object(p.get().as_bytes(), &["max_new_tokens", "n"]).map_err(|_| None)?,
        None => [None, None],
    };
    let max_new_tokens = natural(max_new_tokens, "sampling_params.max_new_tokens")?;
    Ok((max_new_tokens, natural(n, "sampling_params.n")?))
}

/// A non-negative integer, or none (absent or null).
fn natural(raw: Option<&RawValue>, param: &'static str) -> Result<Option<u64>, RequestError> {
    let Some(raw) = given(raw) else { return Ok(None) };
    let value = lax_integer(raw).and_then(|v| u64::try_from(v).ok());
    value.map(Some).ok_or(RequestError::InvalidField { param, expected: "a non-negative integer" })
}

/// The adapter `lora_path` names: a name, or a list of names or nulls (the base model), one a
/// prompt, that all name the same (a batch of several is routed as the base model's).
fn adapter(raw: Option<&RawValue>) -> Result<Option<String>, RequestError> {
    const EXPECTED: &str = "an adapter's name or a list of them";
    let invalid = || RequestError::InvalidField { param: "lora_path", expected: EXPECTED };
    let Some(raw) = raw else { return Ok(None) };
    match serde_json::from_str::<Value>(raw.get()).map_err(|_| invalid())? {
        Value::String(name) => Ok(Some(name)),
        Value::Array(names) => {
            let names: Vec<Option<String>> = names
                .into_iter()
                .map(|name| match name {
                    Value::String(name) => Ok(Some(name)),
                    Value::Null => Ok(None),
                    _ => Err(invalid()),
                })
                .collect::<Result<_, _>>()?;
            let first = names.first().cloned().flatten();
            Ok(first.filter(|_| names.windows(2).all(|pair| pair[0] == pair[1])))
        }
        _ => Err(invalid()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn completion(body: Value) -> Result<Value, RequestError> {
        let read = completion_body(body.to_string().as_bytes())?;
        Ok(serde_json::from_slice(&read).unwrap())
    }

    #[test]
    fn a_generate_request_is_read_as_its_completion() {
        let read = completion(serde_json::json!({
            "text": "Hello there",
            "sampling_params": {"max_new_tokens": 7, "n": 2, "temperature": 0},
            "stream": true,
            "lora_path": "sql",
            "priority": 3,
            "cache_salt": "tenant",
            "rid": "r-1",
        }))
        .unwrap();
        let expected = serde_json::json!({
            "model": "sql",
            "prompt": "Hello there",
            "stream": true,
            "max_tokens": 7,
            "n": 2,
            "priority": 3,
            "cache_salt": "tenant",
        });
        assert_eq!(read, expected);
    }

    #[test]
    fn token_ids_win_over_text_and_defaults_are_sglangs() {
        let read = completion(serde_json::json!({"text": "ignored", "input_ids": [[1, 2], [3]]})).unwrap();
        assert_eq!(read, serde_json::json!({"prompt": [[1, 2], [3]], "max_tokens": 128, "n": 1}));
        let read = completion(serde_json::json!({"input_embeds": [[0.5]], "sampling_params": null})).unwrap();
        assert_eq!(read, serde_json::json!({"prompt_embeds": "", "max_tokens": 128, "n": 1}));
        // One prompt of three tokens is one prompt; a batch of two, two.
        let one =
            completion(serde_json::json!({"input_embeds": [[0.5, 1.0], [0.1, 0.2], [0.3, 0.4]]})).unwrap();
        assert_eq!(one["prompt_embeds"], "");
        let batch = completion(serde_json::json!({"input_embeds": [[[0.5]], [[0.1], [0.2]]]})).unwrap();
        assert_eq!(batch["prompt_embeds"], serde_json::json!([null, null]));
    }

    #[test]
    fn a_batchs_sampling_params_and_adapters_are_read_for_all_its_prompts() {
        let read = completion(serde_json::json!({
            "text": ["a", "b", "c"],
            "sampling_params": [{"max_new_tokens": 4, "n": 3}, {"max_new_tokens": 9, "n": 3}, {"n": 3}],
            "lora_path": ["sql", "sql", "sql"],
            "cache_salt": ["t1", "t2", "t3"],
        }))
        .unwrap();
        assert_eq!(read["max_tokens"], 128, "the third prompt's default is the largest");
        assert_eq!((&read["n"], &read["model"]), (&serde_json::json!(3), &serde_json::json!("sql")));
        assert_eq!(read["cache_salt"], "t1", "the first prompt's");
        for mixed in [serde_json::json!(["sql", "law"]), serde_json::json!([null, "sql"])] {
            let read = completion(serde_json::json!({"text": ["a", "b"], "lora_path": mixed})).unwrap();
            assert_eq!(read.get("model"), None, "{mixed}: the base model's replicas");
        }
        let read = completion(serde_json::json!({"text": "a", "cache_salt": ""})).unwrap();
        assert_eq!(read.get("cache_salt"), None, "an empty salt is none");
    }

    #[test]
    fn malformed_requests_name_the_field_at_fault() {
        let refused = |body: Value| completion(body).unwrap_err();
        assert!(matches!(refused(serde_json::json!({"sampling_params": {}})), RequestError::NoGenerateInput));
        let all = serde_json::json!({"text": "a", "input_ids": [1], "input_embeds": [[0.1]]});
        assert!(matches!(refused(all), RequestError::NoGenerateInput));
        for (body, at) in [
            (serde_json::json!({"input_ids": []}), "input_ids"),
            (serde_json::json!({"input_ids": 5}), "input_ids"),
            (serde_json::json!({"text": 5}), "text"),
            (serde_json::json!({"text": []}), "text"),
            (serde_json::json!({"text": "a", "sampling_params": 3}), "sampling_params"),
            (
                serde_json::json!({"text": "a", "sampling_params": {"max_new_tokens": -1}}),
                "sampling_params.max_new_tokens",
            ),
            (serde_json::json!({"text": "a", "sampling_params": [{"n": "x"}]}), "sampling_params.n"),
            (serde_json::json!({"text": "a", "lora_path": 3}), "lora_path"),
            (serde_json::json!({"text": "a", "lora_path": ["a", "b", 5]}), "lora_path"),
            (serde_json::json!({"text": [1, 2]}), "text"),
            (serde_json::json!({"text": "a", "cache_salt": 5}), "cache_salt"),
        ] {
            match refused(body.clone()) {
                RequestError::InvalidField { param, .. } => assert_eq!(param, at, "{body}"),
                other => panic!("{body}: {other:?}"),
            }
        }
        assert!(matches!(completion_body(b"[1]"), Err(RequestError::NotAnObject)));
    }
}
