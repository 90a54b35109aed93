//! Just enough of OpenAI's `/v1/completions` and `/v1/chat/completions` request bodies to
//! compute a request's token ids (and of Anthropic's `/v1/messages`, through [`anthropic`]).
//!
//! The router forwards the client's original bytes, so parsing here is lenient and
//! borrowing: unknown fields are skipped without being materialised, strings borrow from the
//! body when they contain no escapes, and `null` counts as absent. What *is* read is
//! validated strictly, with one typed [`RequestError`] per problem:
//!
//! | field | accepted |
//! |---|---|
//! | `model` | string (required) |
//! | `prompt` | string, array of strings, array of token ids, array of token-id arrays; an array of strings or of id arrays is a batch |
//! | `messages` | non-empty array of `{role: string, content: string \| null \| [{type: "text", text}]}`; other message keys are kept for templates |
//! | `stream`, `add_generation_prompt` (default true), `add_special_tokens` | bool |
//! | `max_tokens`, `max_completion_tokens` | non-negative integer |
//! | `priority` | integer |
//! | `cache_salt` | non-empty string |
//! | `chat_template_kwargs` | object |
//! | `tools` | array (kept raw for the template) |
//! | `reasoning_effort` | one of [`REASONING_EFFORTS`] |
//!
//! As in vLLM, text content parts are joined with `"\n"` into one string, and
//! `add_special_tokens` defaults to true for completions and false for chat (the template
//! writes the special tokens itself).

pub mod anthropic;
mod ids;
mod messages;
mod object;
mod prompt;
pub mod responses;
mod scan;
pub mod sglang;
pub mod truncation;

use std::borrow::Cow;

use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::Value;
use serde_json::value::RawValue;

use self::messages::parse_messages;
use self::prompt::parse_prompt;
use self::scan::Field;
pub use self::truncation::{Keep, Side, Truncation};
use super::chat_template::Variables;
use super::error::RequestError;

/// Claude Code's per-request attribution, which vLLM leaves out of system prompts (its
/// `cch` value changes with every request).
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// The endpoints whose prompts kvroute understands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/chat/completions`.
    ChatCompletions,
    /// `POST /v1/messages`: Anthropic's Messages API, read as the chat completion request
    /// vLLM makes of it ([`anthropic`]); `Tokenization::readable` converts its body.
    Messages,
    /// `POST /v1/responses`: OpenAI's Responses API, read as the chat completion request
    /// vLLM makes of it ([`responses`]); `Tokenization::readable` converts its body.
    Responses,
    /// `POST /generate`: SGLang's native API, read as the completion request it amounts to
    /// ([`sglang`]); `Tokenization::readable` converts its body.
    Generate,
}

impl Endpoint {
    /// The endpoint served at `path` (query string excluded), if any.
    pub fn from_path(path: &str) -> Option<Self> {
        match path.trim_end_matches('/') {
            "/v1/completions" => Some(Endpoint::Completions),
            "/v1/chat/completions" => Some(Endpoint::ChatCompletions),
            anthropic::MESSAGES_PATH => Some(Endpoint::Messages),
            responses::RESPONSES_PATH => Some(Endpoint::Responses),
            sglang::GENERATE_PATH => Some(Endpoint::Generate),
            _ => None,
        }
    }
}

/// A parsed request of either endpoint, borrowing from the body bytes.
#[derive(Debug)]
pub enum ParsedRequest<'a> {
    /// A `/v1/completions` body.
    Completion(CompletionRequest<'a>),
    /// A `/v1/chat/completions` body.
    Chat(ChatRequest<'a>),
}

impl<'a> ParsedRequest<'a> {
    /// Parses `body` as a request to `endpoint`. A Messages body must be made readable first
    /// (`Tokenization::readable`): as it is, it is refused.
    pub fn parse(endpoint: Endpoint, body: &'a [u8]) -> Result<Self, RequestError> {
        Ok(match endpoint {
            Endpoint::Completions => ParsedRequest::Completion(CompletionRequest::parse(body)?),
            Endpoint::ChatCompletions => ParsedRequest::Chat(ChatRequest::parse(body)?),
            Endpoint::Messages | Endpoint::Responses | Endpoint::Generate => {
                return Err(RequestError::InvalidField {
                    param: "messages",
                    expected: "a completion or chat request (a Messages, Responses or /generate body is read through Tokenization::readable)",
                });
            }
        })
    }

    /// The `model` field: a base model or a LoRA adapter name.
    /// The model the request names; `""` when it names none (the base model).
    pub fn model(&self) -> &str {
        match self {
            ParsedRequest::Completion(r) => &r.model,
            ParsedRequest::Chat(r) => &r.model,
        }
    }

    /// The tenant's `cache_salt`, if any.
    pub fn cache_salt(&self) -> Option<&str> {
        match self {
            ParsedRequest::Completion(r) => r.cache_salt.as_deref(),
            ParsedRequest::Chat(r) => r.cache_salt.as_deref(),
        }
    }

    /// Whether its prompt is a list of prompts (a completion's batch, of one prompt too).
    pub fn is_batch(&self) -> bool {
        matches!(self, ParsedRequest::Completion(r) if matches!(r.prompt, Prompt::TextBatch(_) | Prompt::TokensBatch(_)))
    }

    /// Whether the client asked for a server-sent-event stream.
    pub fn stream(&self) -> bool {
        match self {
            ParsedRequest::Completion(r) => r.stream,
            ParsedRequest::Chat(r) => r.stream,
        }
    }

    /// Which of each prompt's tokens the replica keeps (`truncate_prompt_tokens`).
    pub fn truncation(&self) -> Option<Truncation> {
        match self {
            ParsedRequest::Completion(r) => r.truncation,
            ParsedRequest::Chat(r) => r.truncation,
        }
    }

    /// Whether it asks for its prompt's logprobs, and so reads no cache, read from `body`
    /// sent to `endpoint`: its own fields, or `/generate`'s, which the completion made of it
    /// does not carry ([`asks_prompt_logprobs`]).
    pub fn reads_no_cache(&self, endpoint: Endpoint, body: &[u8]) -> bool {
        match (endpoint, self) {
            (Endpoint::Generate, _) => asks_prompt_logprobs(endpoint, body),
            (_, ParsedRequest::Completion(r)) => r.prompt_logprobs,
            (_, ParsedRequest::Chat(r)) => r.prompt_logprobs,
        }
    }

    /// The output-length limit: for chat, `max_completion_tokens or max_tokens` as vLLM
    /// reads them (Python's `or`: a `max_completion_tokens` of 0 counts as unset).
    pub fn max_tokens(&self) -> Option<u64> {
        match self {
            ParsedRequest::Completion(r) => r.max_tokens,
            ParsedRequest::Chat(r) => r.max_completion_tokens.filter(|&m| m != 0).or(r.max_tokens),
        }
    }

    /// Choices asked for each prompt (`n`, at least 1): vLLM runs each as a request of its
    /// own.
    pub fn n(&self) -> u32 {
        match self {
            ParsedRequest::Completion(r) => r.n,
            ParsedRequest::Chat(r) => r.n,
        }
    }

    /// `priority`: the order of requests under vLLM's priority scheduling, and of requests
    /// waiting in the router's line (lower first).
    pub fn priority(&self) -> i64 {
        match self {
            ParsedRequest::Completion(r) => r.priority,
            ParsedRequest::Chat(r) => r.priority,
        }
    }
}

/// A `/v1/completions` body.
#[derive(Debug)]
pub struct CompletionRequest<'a> {
    /// Base model or LoRA adapter name.
    pub model: Cow<'a, str>,
    /// One prompt or a batch.
    pub prompt: Prompt<'a>,
    /// Server-sent events requested.
    pub stream: bool,
    /// Output-length limit.
    pub max_tokens: Option<u64>,
    /// Choices for each prompt (`n`; 1 when absent, null or 0).
    pub n: u32,
    /// vLLM's priority scheduling order (lower first; 0 when absent).
    pub priority: i64,
    /// Tenant isolation salt for the prefix cache.
    pub cache_salt: Option<Cow<'a, str>>,
    /// Whether text prompts get the tokenizer's special tokens (BOS); default true.
    pub add_special_tokens: bool,
    /// Which of each prompt's tokens the replica keeps (`truncate_prompt_tokens`).
    pub truncation: Option<Truncation>,
    /// It asks for its prompt's logprobs ([`asks_prompt_logprobs`]): it reads no cache.
    pub prompt_logprobs: bool,
}

/// The `prompt` of a completion request, in the shape the client sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt<'a> {
    /// `"prompt": "text"`.
    Text(Cow<'a, str>),
    /// `"prompt": ["text", ...]`: a batch.
    TextBatch(Vec<Cow<'a, str>>),
    /// `"prompt": [1, 2, 3]`: one pre-tokenized prompt.
    Tokens(Vec<u32>),
    /// `"prompt": [[1, 2], [3]]`: a batch of pre-tokenized prompts.
    TokensBatch(Vec<Vec<u32>>),
}

/// One prompt of a (possibly batched) [`Prompt`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptInput<'p> {
    /// Text still to be tokenized.
    Text(&'p str),
    /// Token ids, used as they are.
    Tokens(&'p [u32]),
}

impl Prompt<'_> {
    /// The individual prompts, in order (one for a non-batch prompt).
    pub fn inputs(&self) -> Vec<PromptInput<'_>> {
        match self {
            Prompt::Text(t) => vec![PromptInput::Text(t)],
            Prompt::TextBatch(ts) => ts.iter().map(|t| PromptInput::Text(t)).collect(),
            Prompt::Tokens(ids) => vec![PromptInput::Tokens(ids)],
            Prompt::TokensBatch(b) => b.iter().map(|ids| PromptInput::Tokens(ids)).collect(),
        }
    }

    /// How many prompts this is.
    pub fn len(&self) -> usize {
        match self {
            Prompt::Text(_) | Prompt::Tokens(_) => 1,
            Prompt::TextBatch(b) => b.len(),
            Prompt::TokensBatch(b) => b.len(),
        }
    }

    /// Never true for a parsed prompt; here for symmetry with [`Prompt::len`].
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A `/v1/chat/completions` body.
#[derive(Debug)]
pub struct ChatRequest<'a> {
    /// Base model or LoRA adapter name.
    pub model: Cow<'a, str>,
    /// The conversation, at least one message.
    pub messages: Vec<Message<'a>>,
    /// Server-sent events requested.
    pub stream: bool,
    /// Output-length limit (legacy name).
    pub max_tokens: Option<u64>,
    /// Output-length limit (current name).
    pub max_completion_tokens: Option<u64>,
    /// Choices (`n`; 1 when absent, null or 0).
    pub n: u32,
    /// vLLM's priority scheduling order (lower first; 0 when absent).
    pub priority: i64,
    /// Tenant isolation salt for the prefix cache.
    pub cache_salt: Option<Cow<'a, str>>,
    /// End the prompt with the assistant turn's header; default true.
    pub add_generation_prompt: bool,
    /// End the prompt inside the last message, for the model to go on with it (the client
    /// "prefills" the answer); needs `add_generation_prompt: false`.
    pub continue_final_message: bool,
    /// Whether the rendered prompt also gets the tokenizer's special tokens; default false.
    pub add_special_tokens: bool,
    /// Extra template variables (`{"enable_thinking": false}`), an object if present.
    pub chat_template_kwargs: Option<&'a RawValue>,
    /// Tool definitions, an array if present; templates may render them into the prompt.
    pub tools: Option<&'a RawValue>,
    /// Documents for a retrieval template (Command-R's), an array if present.
    pub documents: Option<&'a RawValue>,
    /// How hard a reasoning model should think: one of [`REASONING_EFFORTS`]; passed to the
    /// template, with `enable_thinking` (unless `chat_template_kwargs` sets it).
    pub reasoning_effort: Option<Cow<'a, str>>,
    /// Whether `tool_choice` is "none".
    pub tool_choice_none: bool,
    /// The request's own chat template (`chat_template`), if it brought one.
    pub chat_template: Option<Cow<'a, str>>,
    /// Which of the prompt's tokens the replica keeps (`truncate_prompt_tokens`).
    pub truncation: Option<Truncation>,
    /// It asks for its prompt's logprobs ([`asks_prompt_logprobs`]): it reads no cache.
    pub prompt_logprobs: bool,
}

/// The values vLLM takes for `reasoning_effort`.
pub const REASONING_EFFORTS: [&str; 7] = ["none", "minimal", "low", "medium", "high", "xhigh", "max"];

/// One chat message.
#[derive(Debug, Clone)]
pub struct Message<'a> {
    /// `system`, `user`, `assistant`, `tool`, ...: any string.
    pub role: Cow<'a, str>,
    /// The text; `None` when `content` is null or absent (e.g. an assistant's tool call).
    /// Parts that are not text ([`Message::media`]) are not in it.
    pub content: Option<Cow<'a, str>>,
    /// The type of the first content part that is not text (`image_url`, `input_audio`,
    /// ...), if any: what such a part becomes in the prompt is up to the replica's model
    /// (its placeholder tokens, and the media's hash in its blocks), so the tokens from it on
    /// cannot be computed from the request alone.
    pub media: Option<Cow<'a, str>>,
    /// Every other key of the message (`name`, `tool_calls`, ...), for the template.
    pub extra: Vec<(Cow<'a, str>, &'a RawValue)>,
    /// When `content` was a list: its text and tool-reference parts, empty ones too (a
    /// template in vLLM's "openai" content format sees them apart).
    pub parts: Option<Vec<Part<'a>>>,
}

/// A part of a list `content` that reaches the template as it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part<'a> {
    /// A text part's text (`text`, `input_text`, `output_text`, or a plain string).
    Text(Cow<'a, str>),
    /// A `refusal` or `thinking` part's text: text to a chat template, nothing to Harmony
    /// (vLLM's Harmony messages read a part's `text` key alone).
    Aside(Cow<'a, str>),
    /// A `tool_reference` part's `name` (none when absent or null): vLLM passes it as
    /// `{"type": "tool_reference", "name": ...}` for the template to expand, or, where the
    /// template takes a string, as the name's text.
    ToolReference(Option<Cow<'a, str>>),
}

impl Part<'_> {
    /// The text the part is in a string content (a reference's name; none is empty).
    pub fn text(&self) -> &str {
        match self {
            Part::Text(text) | Part::Aside(text) => text,
            Part::ToolReference(name) => name.as_deref().unwrap_or_default(),
        }
    }
}

/// What is read of a completion whose prompt comes as embeddings alone (`prompt_embeds`,
/// vLLM with `--enable-prompt-embeds`, and no `prompt`): no token ids can be known. (Beside a
/// `prompt`, which vLLM runs after them in one batch, the prompt is read, limited and routed
/// on as ever.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmbedsRequest {
    pub model: String,
    pub max_tokens: Option<u64>,
    /// Sequences it runs: its embeddings (one, or a list) times `n`, at most [`MAX_N`].
    pub sequences: u32,
    pub priority: i64,
}

impl<'a> CompletionRequest<'a> {
    /// The fields read, in the order [`scan::fields`] returns them.
    const FIELDS: [&'static str; 14] = [
        "model",
        "prompt",
        "stream",
        "max_tokens",
        "cache_salt",
        "add_special_tokens",
        "truncate_prompt_tokens",
        "truncation_side",
        "n",
        "priority",
        "prompt_embeds",
        "prompt_logprobs",
        "echo",
        "logprobs",
    ];

    /// Parses and validates a `/v1/completions` body.
    pub fn parse(body: &'a [u8]) -> Result<Self, RequestError> {
        Self::parse_with(body, true)
    }

    /// [`CompletionRequest::parse`], with or without the [`scan`] fast path.
    fn parse_with(body: &'a [u8], fast: bool) -> Result<Self, RequestError> {
        let fields = match fast.then(|| scan::fields(body, &Self::FIELDS, Some(1))).flatten() {
            Some(fields) => fields,
            None => parse_object(body, &Self::FIELDS)?.map(|f| f.map(Field::Raw)),
        };
        let [
            model_,
            prompt,
            stream,
            max_tokens,
            salt,
            add_special_tokens,
            truncate,
            side,
            n,
            priority_,
            embeds,
            prompt_logprobs,
            echo,
            logprobs,
        ] = fields;
        if let (None, Some(embeds)) = (&prompt, Field::raw(embeds).filter(|e| e.get() != "null")) {
            let prompts = match embeds.get().starts_with('[') {
                true => {
                    serde_json::from_str::<Vec<&RawValue>>(embeds.get()).map_or(1, |list| list.len().max(1))
                }
                false => 1,
            };
            let prompts = u32::try_from(prompts).unwrap_or(u32::MAX);
            let asked = EmbedsRequest {
                model: model(Field::raw(model_))?.into_owned(),
                max_tokens: count(Field::raw(max_tokens), "max_tokens")?,
                sequences: prompts.saturating_mul(choices(Field::raw(n))?).min(MAX_N),
                priority: priority(Field::raw(priority_))?,
            };
            return Err(RequestError::PromptEmbeds(Box::new(asked)));
        }
        let prompt = match prompt.ok_or(RequestError::MissingField { param: "prompt" })? {
            Field::Ids(ids) => Prompt::Tokens(ids),
            Field::Text(text) => Prompt::Text(text),
            Field::Raw(raw) => parse_prompt(raw)?,
        };
        let max_tokens = count(Field::raw(max_tokens), "max_tokens")?;
        Ok(CompletionRequest {
            model: model(Field::raw(model_))?,
            prompt,
            stream: boolean(Field::raw(stream), "stream")?.unwrap_or(false),
            max_tokens,
            n: choices(Field::raw(n))?,
            priority: priority(Field::raw(priority_))?,
            cache_salt: cache_salt(Field::raw(salt))?,
            add_special_tokens: boolean(Field::raw(add_special_tokens), "add_special_tokens")?
                .unwrap_or(true),
            // vLLM's completion `max_tokens` is 16 when unset (or null, since 0.2x).
            truncation: Truncation::parse(Field::raw(truncate), Field::raw(side), max_tokens.or(Some(16)))?,
            prompt_logprobs: logprobs_of_prompt([prompt_logprobs, echo, logprobs].map(Field::raw)),
        })
    }
}

impl<'a> ChatRequest<'a> {
    /// The fields read, in the order [`scan::fields`] returns them.
    const FIELDS: [&'static str; 22] = [
        "model",
        "messages",
        "stream",
        "max_tokens",
        "max_completion_tokens",
        "cache_salt",
        "add_generation_prompt",
        "add_special_tokens",
        "chat_template_kwargs",
        "tools",
        "reasoning_effort",
        "continue_final_message",
        "documents",
        "tool_choice",
        "chat_template",
        "truncate_prompt_tokens",
        "truncation_side",
        "n",
        "priority",
        "prompt_logprobs",
        "echo",
        "logprobs",
    ];

    /// Parses and validates a `/v1/chat/completions` body.
    pub fn parse(body: &'a [u8]) -> Result<Self, RequestError> {
        Self::parse_with(body, true)
    }

    /// Bytes of the messages' text.
    pub fn text_bytes(&self) -> usize {
        self.messages.iter().filter_map(|m| m.content.as_ref()).map(|c| c.len()).sum()
    }

    /// The first message with media ([`Message::media`]): its position and the media's type.
    pub fn first_media(&self) -> Option<(usize, &str)> {
        self.messages.iter().enumerate().find_map(|(i, m)| Some((i, m.media.as_deref()?)))
    }

    /// [`ChatRequest::parse`], with or without the [`scan`] fast path.
    fn parse_with(body: &'a [u8], fast: bool) -> Result<Self, RequestError> {
        let fields = match fast.then(|| scan::fields(body, &Self::FIELDS, None)).flatten() {
            Some(fields) => fields.map(Field::raw),
            None => parse_object(body, &Self::FIELDS)?,
        };
        let [
            model_,
            messages,
            stream,
            max_tokens,
            max_completion_tokens,
            salt,
            add_generation_prompt,
            add_special_tokens,
            chat_template_kwargs,
            tools,
            reasoning_effort,
            continue_final_message,
            documents,
            tool_choice,
            chat_template,
            truncate,
            side,
            n,
            priority_,
            prompt_logprobs,
            echo,
            logprobs,
        ] = fields;
        let messages = messages.ok_or(RequestError::MissingField { param: "messages" })?;
        let messages = parse_messages(messages)?;
        if let Some(kwargs) = chat_template_kwargs
            && !kwargs.get().starts_with('{')
        {
            return Err(RequestError::InvalidField { param: "chat_template_kwargs", expected: "an object" });
        }
        if let Some(tools) = tools
            && !tools.get().starts_with('[')
        {
            return Err(RequestError::InvalidField { param: "tools", expected: "an array" });
        }
        let documents = documents.filter(|d| d.get() != "null");
        if documents.is_some_and(|d| !d.get().starts_with('[')) {
            return Err(RequestError::InvalidField { param: "documents", expected: "an array" });
        }
        let add_generation_prompt = boolean(add_generation_prompt, "add_generation_prompt")?;
        let continue_final_message =
            boolean(continue_final_message, "continue_final_message")?.unwrap_or(false);
        // vLLM's request check refuses both when both are sent; with the default generation
        // prompt, rendering a template refuses it (transformers does), a Harmony chat not.
        if continue_final_message && add_generation_prompt == Some(true) {
            return Err(RequestError::CannotContinue(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            ));
        }
        let add_generation_prompt = add_generation_prompt.unwrap_or(true);
        let max_tokens = count(max_tokens, "max_tokens")?;
        let max_completion_tokens = count(max_completion_tokens, "max_completion_tokens")?;
        // What `-1` leaves room for: `max_completion_tokens or max_tokens`, as vLLM reads them.
        let output = max_completion_tokens.filter(|&m| m != 0).or(max_tokens);
        Ok(ChatRequest {
            model: model(model_)?,
            messages,
            stream: boolean(stream, "stream")?.unwrap_or(false),
            max_tokens,
            max_completion_tokens,
            n: choices(n)?,
            priority: priority(priority_)?,
            cache_salt: cache_salt(salt)?,
            add_generation_prompt,
            continue_final_message,
            add_special_tokens: boolean(add_special_tokens, "add_special_tokens")?.unwrap_or(false),
            chat_template_kwargs,
            tools,
            documents,
            reasoning_effort: match field::<Str<'a>>(reasoning_effort, "reasoning_effort", EFFORT)? {
                Some(Str(effort)) if !REASONING_EFFORTS.contains(&effort.as_ref()) => {
                    return Err(RequestError::InvalidField { param: "reasoning_effort", expected: EFFORT });
                }
                effort => effort.map(|s| s.0),
            },
            tool_choice_none: tool_choice.is_some_and(|t| t.get() == r#""none""#),
            chat_template: field::<Option<Str<'a>>>(chat_template, "chat_template", "a string")?
                .flatten()
                .map(|s| s.0),
            truncation: Truncation::parse(truncate, side, output)?,
            prompt_logprobs: logprobs_of_prompt([prompt_logprobs, echo, logprobs]),
        })
    }

    /// What the request sets of its chat template's variables.
    pub fn variables(&self) -> Variables<'_> {
        Variables {
            add_generation_prompt: self.add_generation_prompt,
            continue_final_message: self.continue_final_message,
            tools: self.tools,
            documents: self.documents,
            chat_template_kwargs: self.chat_template_kwargs,
            reasoning_effort: self.reasoning_effort.as_deref(),
            tool_choice_none: self.tool_choice_none,
            chat_template: self.chat_template.as_deref(),
            beginning: false,
        }
    }
}

const EFFORT: &str = "one of \"none\", \"minimal\", \"low\", \"medium\", \"high\", \"xhigh\", \"max\"";

const NON_NEGATIVE: &str = "a non-negative integer";

/// The fields `names` of the top-level object, read as vLLM reads them (a repeated key's last
/// value counts; [`object::fields`]), telling "not JSON" from "JSON but not an object".
pub fn parse_object<'a, const N: usize>(
    body: &'a [u8],
    names: &[&str; N],
) -> Result<[Option<&'a RawValue>; N], RequestError> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'{') {
        return Err(match serde_json::from_slice::<IgnoredAny>(body) {
            Ok(_) => RequestError::NotAnObject,
            Err(e) => RequestError::Json(e),
        });
    }
    object::fields(body, names).map_err(RequestError::Json)
}

/// A string that borrows from the body when it has no escapes.
#[derive(Deserialize)]
struct Str<'a>(#[serde(borrow)] Cow<'a, str>);

/// An optional field of type `T`; `null` is absent, a wrong type is [`RequestError::InvalidField`].
fn field<'a, T: Deserialize<'a>>(
    raw: Option<&'a RawValue>,
    param: &'static str,
    expected: &'static str,
) -> Result<Option<T>, RequestError> {
    raw.map(|r| serde_json::from_str(r.get()).map_err(|_| RequestError::InvalidField { param, expected }))
        .transpose()
}

/// An optional boolean as pydantic's default (lax) mode reads one, and so vLLM: `true` and
/// `false`, `0` and `1`, and the strings `"true"`, `"yes"`, `"on"`, `"1"`, `"t"`, `"y"` and
/// their opposites; `null` is absent, anything else [`RequestError::InvalidField`].
fn boolean(raw: Option<&RawValue>, param: &'static str) -> Result<Option<bool>, RequestError> {
    let Some(raw) = raw else { return Ok(None) };
    lax_boolean(raw).map(Some).ok_or(RequestError::InvalidField { param, expected: "a boolean" })
}

/// A boolean as pydantic's lax mode reads one ([`boolean`]), or none.
pub(super) fn lax_boolean(raw: &RawValue) -> Option<bool> {
    lax_boolean_value(&serde_json::from_str(raw.get()).ok()?)
}

/// [`lax_boolean`] of a parsed value: `true`/`false`, 1/0, or one of pydantic's words.
pub fn lax_boolean_value(value: &Value) -> Option<bool> {
    match value {
        Value::Bool(b) => Some(*b),
        Value::Number(n) => match n.as_f64() {
            Some(0.0) => Some(false),
            Some(1.0) => Some(true),
            _ => None,
        },
        Value::String(s) => match s.to_ascii_lowercase().as_str() {
            "0" | "off" | "f" | "false" | "n" | "no" => Some(false),
            "1" | "on" | "t" | "true" | "y" | "yes" => Some(true),
            _ => None,
        },
        _ => None,
    }
}

/// An optional non-negative integer as pydantic's lax mode reads one ([`lax_integer`]);
/// `null` is absent, anything else [`RequestError::InvalidField`].
fn count(raw: Option<&RawValue>, param: &'static str) -> Result<Option<u64>, RequestError> {
    let Some(raw) = raw else { return Ok(None) };
    let value = lax_integer(raw).and_then(|v| u64::try_from(v).ok());
    value.map(Some).ok_or(RequestError::InvalidField { param, expected: NON_NEGATIVE })
}

/// Whether a request to `endpoint` asks for its prompt's logprobs (`prompt_logprobs`, or `echo`
/// with `logprobs`; of `/generate`, `return_logprob` with a `logprob_start_len` of 0 or more: -1,
/// SGLang's default, asks for the output's only), a repeated key's last value counting, neither
/// null nor false. Such a request reads no prefix cache: vLLM skips the lookup (it needs
/// every prompt token's logprob), SGLang matches no prefix before `logprob_start_len`.
pub fn asks_prompt_logprobs(endpoint: Endpoint, body: &[u8]) -> bool {
    if endpoint == Endpoint::Generate {
        // Each is one value, or a list of them, one a prompt: any prompt's counts.
        let any = |raw: Option<&RawValue>, is: fn(&Value) -> bool| match raw
            .and_then(|raw| serde_json::from_str::<Value>(raw.get()).ok())
        {
            Some(Value::Array(values)) => values.iter().any(is),
            Some(value) => is(&value),
            None => false,
        };
        let asked = |raw| any(raw, |v| lax_boolean_value(v) == Some(true));
        let from_prompt = |raw| any(raw, |v| v.as_i64().is_some_and(|start| start >= 0));
        return match parse_object(body, &["return_logprob", "logprob_start_len"]) {
            Ok([return_logprob, start]) => asked(return_logprob) && from_prompt(start),
            Err(_) => false,
        };
    }
    parse_object(body, &["prompt_logprobs", "echo", "logprobs"]).is_ok_and(logprobs_of_prompt)
}

/// Whether `prompt_logprobs`, `echo` and `logprobs` ask for the prompt's logprobs: the first
/// set, or both others (neither null nor false).
fn logprobs_of_prompt([prompt_logprobs, echo, logprobs]: [Option<&RawValue>; 3]) -> bool {
    let set = |raw: Option<&RawValue>| raw.is_some_and(|raw| !matches!(raw.get(), "null" | "false"));
    set(prompt_logprobs) || (set(echo) && set(logprobs))
}

/// `priority`, vLLM's order of requests under its priority scheduling (lower first): an
/// integer as pydantic's lax mode reads one ([`lax_integer`]), 0 when absent or `null`.
fn priority(raw: Option<&RawValue>) -> Result<i64, RequestError> {
    let Some(raw) = raw else { return Ok(0) };
    let value = lax_integer(raw).and_then(|v| i64::try_from(v).ok());
    value.ok_or(RequestError::InvalidField { param: "priority", expected: "an integer" })
}

/// An integer as pydantic's lax mode reads one: an integer, a number with no fractional part
/// (`256.0`, as Python's `json.dumps` writes a float), a string of digits (a sign, and a
/// decimal part of zeros, allowed), or a boolean.
pub(super) fn lax_integer(raw: &RawValue) -> Option<i128> {
    match serde_json::from_str(raw.get()).ok()? {
        Value::Number(n) => n
            .as_i64()
            .map(i128::from)
            .or_else(|| n.as_u64().map(i128::from))
            .or_else(|| n.as_f64().filter(|v| v.fract() == 0.0 && v.abs() < 1e30).map(|v| v as i128)),
        // pydantic takes "256.0" and "256." too: a decimal part of zeros.
        Value::String(s) => {
            let s = s.trim();
            let whole = s.split_once('.').filter(|(_, zeros)| zeros.bytes().all(|b| b == b'0'));
            whole.map_or(s, |(whole, _)| whole).parse().ok()
        }
        Value::Bool(b) => Some(i128::from(b)),
        _ => None,
    }
}

/// vLLM's bound on `n` (`VLLM_MAX_N_SEQUENCES`' default); the replica refuses more.
pub const MAX_N: u32 = 16384;

/// `n`: 1 when absent (or 0, which the replica refuses), at most [`MAX_N`].
fn choices(raw: Option<&RawValue>) -> Result<u32, RequestError> {
    Ok(count(raw, "n")?.map_or(1, |n| n.clamp(1, u64::from(MAX_N)) as u32))
}

/// `v` as a u64 when it is one exactly.
fn whole_u64(v: f64) -> Option<u64> {
    // 2^64 is exact as an f64; every whole f64 below it converts exactly.
    (v.fract() == 0.0 && (0.0..18_446_744_073_709_551_616.0).contains(&v)).then_some(v as u64)
}

/// The `model`; absent or null is `""`, which (as in vLLM, where `model` is optional) means
/// the served base model.
fn model<'a>(raw: Option<&'a RawValue>) -> Result<Cow<'a, str>, RequestError> {
    Ok(field::<Str<'a>>(raw, "model", "a string")?.map_or(Cow::Borrowed(""), |s| s.0))
}

fn cache_salt<'a>(raw: Option<&'a RawValue>) -> Result<Option<Cow<'a, str>>, RequestError> {
    const EXPECTED: &str = "a non-empty string";
    match field::<Str<'a>>(raw, "cache_salt", EXPECTED)? {
        Some(Str(s)) if s.is_empty() => {
            Err(RequestError::InvalidField { param: "cache_salt", expected: EXPECTED })
        }
        other => Ok(other.map(|s| s.0)),
    }
}

#[cfg(test)]
mod tests;
