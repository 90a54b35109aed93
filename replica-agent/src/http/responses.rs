//! OpenAI's Responses API as vLLM serves it for a chat-template model
//! (`vllm/entrypoints/openai/responses/`, vLLM 0.33): the request is read as the chat request
//! vLLM makes of it (`kvroute_proto::openai::request::responses`), and with
//! `--responses-store` (vLLM's `VLLM_ENABLE_RESPONSES_API_STORE=1`) each response is kept in
//! this process, so a later request can continue it (`previous_response_id`), fetch it
//! (`GET /v1/responses/{id}`) or try to cancel it.
//!
//! A response (`id` first, compact JSON, as vLLM writes it):
//!
//! ```text
//! {"id":"resp_…","created_at","incomplete_details":{"reason":"max_output_tokens"},"model",
//!  "object":"response","output":[{"id":"msg_…","content":[{"annotations":[],
//!  "text","type":"output_text"}],"role":"assistant","status":"incomplete","type":"message"}],
//!  "previous_response_id","status":"incomplete","usage":{"input_tokens",
//!  "input_tokens_details":{"cached_tokens"},"output_tokens","output_tokens_details":
//!  {"reasoning_tokens":0},"total_tokens"}}
//! ```
//!
//! Every answer stops at its output limit, so it is `incomplete`. A stream is named events:
//! `response.created` and `response.in_progress` (the response, no output yet), the message's
//! `response.output_item.added` and `response.content_part.added`, one
//! `response.output_text.delta` a token, then `response.output_text.done`,
//! `response.content_part.done`, `response.output_item.done` and `response.incomplete` with
//! the whole response.
//!
//! The store keeps what vLLM keeps: the messages the prompt was made of and the response.
//! Continuing one puts the new instructions first, then the earlier messages without their
//! system ones, then the earlier output's text as an assistant message, then the new input.
//! It keeps everything until the agent stops, as vLLM's does. Without it, `store` is taken as
//! false and any id is unknown: 404, `Response with id '…' not found.`
//!
//! A request with `"background": true` (which needs the store, and `store` not false: vLLM's
//! 400s) is answered at once with the response `queued` (no output, no usage), stored so;
//! its generation goes on in a task of its own and stores the response at its end (`failed`
//! if the engine fails it). Until then `POST /v1/responses/{id}/cancel` stops it and stores
//! it `cancelled` (vLLM's answer is that response); after, it is vLLM's 400. A background
//! stream is not simulated (400): vLLM's goes on when its client leaves.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use hyper::StatusCode;
use kvroute_proto::openai::request::responses::{Responses, asks_to_store, runs_in_background};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use super::error::ApiError;
use super::generate::{Admitted, Meta, Tally, UsageJson};
use crate::engine::Output;

/// The responses this process made, by id (empty without `--responses-store`).
#[derive(Debug, Default)]
pub(crate) struct Store {
    enabled: bool,
    kept: Mutex<Kept>,
}

#[derive(Debug, Default)]
struct Kept {
    responses: HashMap<String, Arc<Stored>>,
    /// Background responses still generating.
    running: HashMap<String, Running>,
}

#[derive(Debug)]
struct Stored {
    /// The chat messages its prompt was made of.
    messages: Vec<Box<RawValue>>,
    /// Its output text (none before a background response's generation ends).
    text: Option<String>,
    /// The response as answered (or as it stands, in the background).
    json: Vec<u8>,
}

/// A background response's generation.
#[derive(Debug)]
struct Running {
    task: tokio::task::AbortHandle,
    /// The response once cancelled.
    cancelled: Vec<u8>,
}

impl Store {
    pub fn new(enabled: bool) -> Self {
        Store { enabled, kept: Mutex::default() }
    }

    fn kept(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.kept.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn get(&self, id: &str) -> Option<Arc<Stored>> {
        self.kept().responses.get(id).cloned()
    }

    /// `GET /v1/responses/{id}`.
    pub fn retrieve(&self, id: &str) -> Result<Vec<u8>, ApiError> {
        self.get(id).map(|s| s.json.clone()).ok_or_else(|| not_found(id))
    }

    /// `POST /v1/responses/{id}/cancel`: stops a background response still generating; any
    /// other is vLLM's 400 (it calls every response that is neither `queued` nor
    /// `in_progress` synchronous).
    pub fn cancel(&self, id: &str) -> Result<Vec<u8>, ApiError> {
        let mut kept = self.kept();
        let stored = kept.responses.get(id).cloned().ok_or_else(|| not_found(id))?;
        let Some(running) = kept.running.remove(id) else {
            return Err(ApiError::invalid_field("response_id", "Cannot cancel a synchronous response."));
        };
        running.task.abort();
        let json = running.cancelled;
        let cancelled = Stored { messages: stored.messages.clone(), text: None, json: json.clone() };
        kept.responses.insert(id.to_owned(), Arc::new(cancelled));
        Ok(json)
    }
}

/// vLLM's answer for an id it does not have.
fn not_found(id: &str) -> ApiError {
    let mut e = ApiError::invalid_field("response_id", format!("Response with id '{id}' not found."));
    e.status = StatusCode::NOT_FOUND;
    e.error.code = Some("404".into());
    e
}

/// A Responses request made ready for generation.
pub(super) struct Prepared {
    /// The chat request to generate from.
    pub chat: Vec<u8>,
    /// What to store of it, when it is stored.
    pub keep: Option<Keep>,
    pub previous: Option<String>,
    /// Whether it runs in the background (`background: true`; then `keep` is set).
    pub background: bool,
}

/// A streamed response's progress: its text so far (for the store) and its events' count.
pub(super) struct Streaming {
    pub keep: Option<Keep>,
    pub previous: Option<String>,
    pub text: String,
    pub sequence: u64,
}

/// What a response is stored with once it is answered.
pub(super) struct Keep {
    store: Arc<Store>,
    messages: Vec<Box<RawValue>>,
    previous: Option<String>,
}

impl Keep {
    /// Stores the answered response.
    pub fn store(self, meta: &Meta, text: &str, usage: &UsageJson) {
        let json = response(meta, text, usage, self.previous.as_deref());
        let stored = Stored { messages: self.messages, text: Some(text.to_owned()), json };
        self.store.kept().responses.insert(meta.id.clone(), Arc::new(stored));
    }

    /// Stores the response `queued` and generates it in the background from `admitted` (one
    /// prompt, submitted to the engine), storing it at its end unless it was cancelled first;
    /// the queued response is the answer.
    pub fn in_background(self, meta: Meta, mut admitted: Admitted) -> Vec<u8> {
        let Keep { store, messages, previous } = self;
        let stated = |status| json(&Response { status, ..object(&meta, None, None, previous.as_deref()) });
        let (queued, cancelled, failed) = (stated("queued"), stated("cancelled"), stated("failed"));
        let mut kept = store.kept();
        let stored = Stored { messages, text: None, json: queued.clone() };
        kept.responses.insert(meta.id.clone(), Arc::new(stored));
        let id = meta.id.clone();
        let ends = store.clone();
        // The store stays locked until the task is entered as running: it cannot end before.
        let task = tokio::spawn(async move {
            let mut text = String::new();
            let mut tally = Tally::new(1, 1, false);
            let done = loop {
                match admitted.rx.recv().await {
                    Some(Output::Token(t)) => text.push_str(t),
                    Some(Output::Started { .. }) => {}
                    Some(Output::Done(usage)) => {
                        tally.done(0, &usage);
                        break true;
                    }
                    Some(Output::Failed(_)) | None => break false,
                }
            };
            let mut kept = ends.kept();
            if kept.running.remove(&meta.id).is_none() {
                return;
            }
            let Some(earlier) = kept.responses.get(&meta.id).cloned() else { return };
            let messages = earlier.messages.clone();
            let stored = match done {
                true => {
                    let json = response(&meta, &text, &tally.usage(), previous.as_deref());
                    Stored { messages, text: Some(text), json }
                }
                false => Stored { messages, text: None, json: failed },
            };
            kept.responses.insert(meta.id.clone(), Arc::new(stored));
        });
        kept.running.insert(id, Running { task: task.abort_handle(), cancelled });
        queued
    }
}

/// Reads a Responses request (for gpt-oss when `harmony`), with the stored conversation it
/// continues.
pub(super) fn prepare(store: &Arc<Store>, body: &[u8], harmony: bool) -> Result<Prepared, ApiError> {
    #[derive(Deserialize)]
    struct Chat {
        messages: Vec<Box<RawValue>>,
    }
    let request = Responses::read_as(body, harmony)?;
    let asked_to_store = asks_to_store(body)?;
    let background = runs_in_background(body)?;
    if background {
        if !asked_to_store {
            return Err(ApiError::bad_request("background can only be used when `store` is true"));
        }
        if !store.enabled {
            return Err(ApiError::bad_request(
                "This vLLM engine does not support `store=True` and therefore does not support the \
                 background mode. To enable these features, set the environment variable \
                 `VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
            ));
        }
    }
    let previous = request.previous_response_id.as_deref().map(str::to_owned);
    let earlier = match &previous {
        Some(id) => Some(store.get(id).ok_or_else(|| not_found(id))?),
        None => None,
    };
    let mut history: Vec<Box<RawValue>> = Vec::new();
    if let Some(earlier) = &earlier {
        #[derive(Deserialize)]
        struct Role<'a> {
            role: Option<&'a str>,
        }
        let kept = earlier
            .messages
            .iter()
            .filter(|m| serde_json::from_str::<Role>(m.get()).map_or(true, |r| r.role != Some("system")));
        history.extend(kept.cloned());
        // (A background response not yet generated has no output to carry over.)
        if let Some(text) = &earlier.text {
            history.push(assistant(text));
        }
    }
    let borrowed: Vec<&RawValue> = history.iter().map(|m| &**m).collect();
    let chat = request.chat_body(&borrowed);
    let keep = (store.enabled && asked_to_store)
        .then(|| serde_json::from_slice::<Chat>(&chat).map(|c| c.messages))
        .transpose()
        .map_err(|e| ApiError::bad_request(format!("could not read the converted request: {e}")))?
        .map(|messages| Keep { store: store.clone(), messages, previous: previous.clone() });
    Ok(Prepared { chat, keep, previous, background })
}

fn assistant(text: &str) -> Box<RawValue> {
    #[derive(Serialize)]
    struct Assistant<'a> {
        role: &'static str,
        content: &'a str,
    }
    // A string: serializing cannot fail.
    serde_json::value::to_raw_value(&Assistant { role: "assistant", content: text }).unwrap_or_default()
}

#[derive(Serialize)]
struct Response<'a> {
    id: &'a str,
    created_at: u64,
    incomplete_details: Option<Incomplete>,
    model: &'a str,
    object: &'static str,
    output: Vec<Item<'a>>,
    previous_response_id: Option<&'a str>,
    status: &'static str,
    usage: Option<Usage>,
}

#[derive(Serialize)]
struct Incomplete {
    reason: &'static str,
}

#[derive(Serialize)]
struct Item<'a> {
    id: String,
    content: Vec<Part<'a>>,
    role: &'static str,
    status: &'static str,
    #[serde(rename = "type")]
    kind: &'static str,
}

#[derive(Serialize)]
struct Part<'a> {
    annotations: [(); 0],
    text: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
}

#[derive(Serialize)]
struct Usage {
    input_tokens: u64,
    input_tokens_details: Cached,
    output_tokens: u64,
    output_tokens_details: Reasoning,
    total_tokens: u64,
}

#[derive(Serialize)]
struct Cached {
    cached_tokens: u64,
}

#[derive(Serialize)]
struct Reasoning {
    reasoning_tokens: u64,
}

impl From<&UsageJson> for Usage {
    fn from(u: &UsageJson) -> Self {
        Usage {
            input_tokens: u.prompt_tokens,
            input_tokens_details: Cached { cached_tokens: u.prompt_tokens_details.cached_tokens },
            output_tokens: u.completion_tokens,
            output_tokens_details: Reasoning { reasoning_tokens: 0 },
            total_tokens: u.total_tokens,
        }
    }
}

fn message_id(meta: &Meta) -> String {
    format!("msg_{}", meta.id.trim_start_matches("resp_"))
}

fn item<'a>(meta: &Meta, text: Option<&'a str>, status: &'static str) -> Item<'a> {
    Item {
        id: message_id(meta),
        content: text.map(|text| Part { annotations: [], text, kind: "output_text" }).into_iter().collect(),
        role: "assistant",
        status,
        kind: "message",
    }
}

fn object<'a>(
    meta: &'a Meta,
    output: Option<&'a str>,
    usage: Option<&UsageJson>,
    previous: Option<&'a str>,
) -> Response<'a> {
    let done = output.is_some();
    Response {
        id: &meta.id,
        created_at: meta.created,
        incomplete_details: done.then_some(Incomplete { reason: "max_output_tokens" }),
        model: &meta.model,
        object: "response",
        output: output.map(|text| item(meta, Some(text), "incomplete")).into_iter().collect(),
        previous_response_id: previous,
        status: if done { "incomplete" } else { "in_progress" },
        usage: usage.map(Usage::from),
    }
}

fn json(value: &impl Serialize) -> Vec<u8> {
    // Strings, integers and options only: serializing into a Vec cannot fail.
    serde_json::to_vec(value).unwrap_or_default()
}

/// The non-streaming response.
pub(super) fn response(meta: &Meta, text: &str, usage: &UsageJson, previous: Option<&str>) -> Vec<u8> {
    json(&object(meta, Some(text), Some(usage), previous))
}

/// An event: `event: TYPE\ndata: {…,"sequence_number":N,"type":TYPE}\n\n`, the event's
/// fields first, as vLLM's events serialize.
fn event(buf: &mut Vec<u8>, sequence: &mut u64, kind: &str, fields: &impl Serialize) {
    #[derive(Serialize)]
    struct Event<'a, F> {
        #[serde(flatten)]
        fields: &'a F,
        sequence_number: u64,
        #[serde(rename = "type")]
        kind: &'a str,
    }
    let data = json(&Event { fields, sequence_number: *sequence, kind });
    *sequence += 1;
    buf.extend_from_slice(b"event: ");
    buf.extend_from_slice(kind.as_bytes());
    buf.extend_from_slice(b"\ndata: ");
    buf.extend_from_slice(&data);
    buf.extend_from_slice(b"\n\n");
}

#[derive(Serialize)]
struct WithResponse<'a> {
    response: Response<'a>,
}

#[derive(Serialize)]
struct At {
    item_id: String,
    output_index: u32,
    content_index: u32,
}

/// A stream's events sent at once, before the engine's first output, as vLLM sends them
/// before it reads the engine: `response.created` and `response.in_progress`.
pub(super) fn opening(meta: &Meta, previous: Option<&str>, sequence: &mut u64) -> Vec<u8> {
    let mut buf = Vec::new();
    for kind in ["response.created", "response.in_progress"] {
        event(&mut buf, sequence, kind, &WithResponse { response: object(meta, None, None, previous) });
    }
    buf
}

/// The events that open the output, sent with the first token: the message item and its
/// text part.
pub(super) fn output_opened(buf: &mut Vec<u8>, meta: &Meta, sequence: &mut u64) {
    #[derive(Serialize)]
    struct ItemAdded<'a> {
        item: Item<'a>,
        output_index: u32,
    }
    #[derive(Serialize)]
    struct PartAdded<'a> {
        #[serde(flatten)]
        at: At,
        part: Part<'a>,
    }
    let added = ItemAdded { item: item(meta, None, "in_progress"), output_index: 0 };
    event(buf, sequence, "response.output_item.added", &added);
    let part = PartAdded { at: at(meta), part: Part { annotations: [], text: "", kind: "output_text" } };
    event(buf, sequence, "response.content_part.added", &part);
}

fn at(meta: &Meta) -> At {
    At { item_id: message_id(meta), output_index: 0, content_index: 0 }
}

/// One token of text.
pub(super) fn delta(buf: &mut Vec<u8>, meta: &Meta, text: &str, sequence: &mut u64) {
    #[derive(Serialize)]
    struct Delta<'a> {
        #[serde(flatten)]
        at: At,
        delta: &'a str,
        logprobs: [(); 0],
    }
    event(buf, sequence, "response.output_text.delta", &Delta { at: at(meta), delta: text, logprobs: [] });
}

/// The events after the last token, ending with the whole response.
pub(super) fn closing(
    buf: &mut Vec<u8>,
    meta: &Meta,
    (text, usage): (&str, &UsageJson),
    previous: Option<&str>,
    sequence: &mut u64,
) {
    #[derive(Serialize)]
    struct TextDone<'a> {
        #[serde(flatten)]
        at: At,
        text: &'a str,
        logprobs: [(); 0],
    }
    #[derive(Serialize)]
    struct PartDone<'a> {
        #[serde(flatten)]
        at: At,
        part: Part<'a>,
    }
    #[derive(Serialize)]
    struct ItemDone<'a> {
        item: Item<'a>,
        output_index: u32,
    }
    event(buf, sequence, "response.output_text.done", &TextDone { at: at(meta), text, logprobs: [] });
    let part = Part { annotations: [], text, kind: "output_text" };
    event(buf, sequence, "response.content_part.done", &PartDone { at: at(meta), part });
    let done = ItemDone { item: item(meta, Some(text), "incomplete"), output_index: 0 };
    event(buf, sequence, "response.output_item.done", &done);
    let whole = WithResponse { response: object(meta, Some(text), Some(usage), previous) };
    event(buf, sequence, "response.incomplete", &whole);
}

/// The `error` event that ends a failed stream.
pub(super) fn error(buf: &mut Vec<u8>, error: &kvroute_proto::openai::OpenAiError, sequence: &mut u64) {
    #[derive(Serialize)]
    struct Failure<'a> {
        code: Option<&'a str>,
        message: &'a str,
        param: Option<&'a str>,
    }
    let failure =
        Failure { code: error.code.as_deref(), message: &error.message, param: error.param.as_deref() };
    event(buf, sequence, "error", &failure);
}
