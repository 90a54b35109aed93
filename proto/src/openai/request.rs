//! Just enough of OpenAI's `/v1/completions` and `/v1/chat/completions` request bodies to
//! compute a request's token ids.
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
//! | `cache_salt` | non-empty string |
//! | `chat_template_kwargs` | object |
//! | `tools` | array (kept raw for the template) |
//!
//! As in vLLM, text content parts are joined with `"\n"` into one string, and
//! `add_special_tokens` defaults to true for completions and false for chat (the template
//! writes the special tokens itself).

use std::borrow::Cow;
use std::fmt;

use serde::Deserialize;
use serde::de::{self, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

use super::error::{MessageProblem, RequestError};

/// The two OpenAI endpoints whose prompts kvroute understands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/chat/completions`.
    ChatCompletions,
}

impl Endpoint {
    /// The endpoint served at `path` (query string excluded), if any.
    pub fn from_path(path: &str) -> Option<Self> {
        match path.trim_end_matches('/') {
            "/v1/completions" => Some(Endpoint::Completions),
            "/v1/chat/completions" => Some(Endpoint::ChatCompletions),
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
    /// Parses `body` as a request to `endpoint`.
    pub fn parse(endpoint: Endpoint, body: &'a [u8]) -> Result<Self, RequestError> {
        Ok(match endpoint {
            Endpoint::Completions => ParsedRequest::Completion(CompletionRequest::parse(body)?),
            Endpoint::ChatCompletions => ParsedRequest::Chat(ChatRequest::parse(body)?),
        })
    }

    /// The `model` field: a base model or a LoRA adapter name.
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

    /// Whether the client asked for a server-sent-event stream.
    pub fn stream(&self) -> bool {
        match self {
            ParsedRequest::Completion(r) => r.stream,
            ParsedRequest::Chat(r) => r.stream,
        }
    }

    /// The output-length limit (`max_completion_tokens` wins over `max_tokens` for chat).
    pub fn max_tokens(&self) -> Option<u64> {
        match self {
            ParsedRequest::Completion(r) => r.max_tokens,
            ParsedRequest::Chat(r) => r.max_completion_tokens.or(r.max_tokens),
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
    /// Tenant isolation salt for the prefix cache.
    pub cache_salt: Option<Cow<'a, str>>,
    /// Whether text prompts get the tokenizer's special tokens (BOS); default true.
    pub add_special_tokens: bool,
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
    /// Tenant isolation salt for the prefix cache.
    pub cache_salt: Option<Cow<'a, str>>,
    /// End the prompt with the assistant turn's header; default true.
    pub add_generation_prompt: bool,
    /// Whether the rendered prompt also gets the tokenizer's special tokens; default false.
    pub add_special_tokens: bool,
    /// Extra template variables (`{"enable_thinking": false}`), an object if present.
    pub chat_template_kwargs: Option<&'a RawValue>,
    /// Tool definitions, an array if present; templates may render them into the prompt.
    pub tools: Option<&'a RawValue>,
}

/// One chat message.
#[derive(Debug, Clone)]
pub struct Message<'a> {
    /// `system`, `user`, `assistant`, `tool`, ...: any string.
    pub role: Cow<'a, str>,
    /// The text; `None` when `content` is null or absent (e.g. an assistant's tool call).
    pub content: Option<Cow<'a, str>>,
    /// Every other key of the message (`name`, `tool_calls`, ...), for the template.
    pub extra: Vec<(Cow<'a, str>, &'a RawValue)>,
}

#[derive(Deserialize)]
struct RawCompletion<'a> {
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    #[serde(borrow)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow)]
    stream: Option<&'a RawValue>,
    #[serde(borrow)]
    max_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    cache_salt: Option<&'a RawValue>,
    #[serde(borrow)]
    add_special_tokens: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct RawChat<'a> {
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    #[serde(borrow)]
    messages: Option<&'a RawValue>,
    #[serde(borrow)]
    stream: Option<&'a RawValue>,
    #[serde(borrow)]
    max_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    max_completion_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    cache_salt: Option<&'a RawValue>,
    #[serde(borrow)]
    add_generation_prompt: Option<&'a RawValue>,
    #[serde(borrow)]
    add_special_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    chat_template_kwargs: Option<&'a RawValue>,
    #[serde(borrow)]
    tools: Option<&'a RawValue>,
}

impl<'a> CompletionRequest<'a> {
    /// Parses and validates a `/v1/completions` body.
    pub fn parse(body: &'a [u8]) -> Result<Self, RequestError> {
        let raw: RawCompletion<'a> = parse_object(body)?;
        let prompt = raw.prompt.ok_or(RequestError::MissingField { param: "prompt" })?;
        Ok(CompletionRequest {
            model: model(raw.model)?,
            prompt: parse_prompt(prompt)?,
            stream: field(raw.stream, "stream", "a boolean")?.unwrap_or(false),
            max_tokens: field(raw.max_tokens, "max_tokens", NON_NEGATIVE)?,
            cache_salt: cache_salt(raw.cache_salt)?,
            add_special_tokens: field(raw.add_special_tokens, "add_special_tokens", "a boolean")?
                .unwrap_or(true),
        })
    }
}

impl<'a> ChatRequest<'a> {
    /// Parses and validates a `/v1/chat/completions` body.
    pub fn parse(body: &'a [u8]) -> Result<Self, RequestError> {
        let raw: RawChat<'a> = parse_object(body)?;
        let messages = raw.messages.ok_or(RequestError::MissingField { param: "messages" })?;
        let messages = parse_messages(messages)?;
        if let Some(kwargs) = raw.chat_template_kwargs
            && !kwargs.get().starts_with('{')
        {
            return Err(RequestError::InvalidField { param: "chat_template_kwargs", expected: "an object" });
        }
        if let Some(tools) = raw.tools
            && !tools.get().starts_with('[')
        {
            return Err(RequestError::InvalidField { param: "tools", expected: "an array" });
        }
        Ok(ChatRequest {
            model: model(raw.model)?,
            messages,
            stream: field(raw.stream, "stream", "a boolean")?.unwrap_or(false),
            max_tokens: field(raw.max_tokens, "max_tokens", NON_NEGATIVE)?,
            max_completion_tokens: field(raw.max_completion_tokens, "max_completion_tokens", NON_NEGATIVE)?,
            cache_salt: cache_salt(raw.cache_salt)?,
            add_generation_prompt: field(raw.add_generation_prompt, "add_generation_prompt", "a boolean")?
                .unwrap_or(true),
            add_special_tokens: field(raw.add_special_tokens, "add_special_tokens", "a boolean")?
                .unwrap_or(false),
            chat_template_kwargs: raw.chat_template_kwargs,
            tools: raw.tools,
        })
    }
}

const NON_NEGATIVE: &str = "a non-negative integer";

/// Deserializes the top-level object, telling "not JSON" from "JSON but not an object".
fn parse_object<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, RequestError> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'{') {
        return Err(match serde_json::from_slice::<IgnoredAny>(body) {
            Ok(_) => RequestError::NotAnObject,
            Err(e) => RequestError::Json(e),
        });
    }
    serde_json::from_slice(body).map_err(RequestError::Json)
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

fn model<'a>(raw: Option<&'a RawValue>) -> Result<Cow<'a, str>, RequestError> {
    field::<Str<'a>>(raw, "model", "a string")?
        .map(|s| s.0)
        .ok_or(RequestError::MissingField { param: "model" })
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

// ---- prompt -------------------------------------------------------------------------------

/// One element of a top-level prompt array, classified without failing the parse.
enum Item<'a> {
    Text(Cow<'a, str>),
    Id(u32),
    Ids(Vec<u32>),
    /// A number that is not a valid token id.
    BadId,
    /// Anything else (null, bool, object, nested strings, ...).
    Other,
}

fn parse_prompt<'a>(raw: &'a RawValue) -> Result<Prompt<'a>, RequestError> {
    struct PromptVisitor;
    impl<'de> Visitor<'de> for PromptVisitor {
        type Value = Result<Prompt<'de>, RequestError>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a prompt")
        }
        fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
            Ok(Ok(Prompt::Text(Cow::Borrowed(v))))
        }
        fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
            Ok(Ok(Prompt::Text(Cow::Owned(v))))
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok(Ok(Prompt::Text(Cow::Owned(v.to_owned()))))
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut items = Vec::new();
            while let Some(item) = seq.next_element::<Item<'de>>()? {
                items.push(item);
            }
            Ok(classify(items))
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(Err(RequestError::BadPromptType))
        }
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Ok(Err(RequestError::BadPromptType))
        }
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Ok(Err(RequestError::BadPromptType))
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Ok(Err(RequestError::BadPromptType))
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Ok(Err(RequestError::BadPromptType))
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            Ok(Err(RequestError::BadPromptType))
        }
    }
    let mut de = serde_json::Deserializer::from_str(raw.get());
    de::Deserializer::deserialize_any(&mut de, PromptVisitor).map_err(RequestError::Json)?
}

/// Turns a top-level prompt array into a [`Prompt`]: all elements must be of one kind.
fn classify(items: Vec<Item<'_>>) -> Result<Prompt<'_>, RequestError> {
    let Some(first) = items.first() else { return Err(RequestError::EmptyPrompt) };
    match first {
        Item::Text(_) => items
            .into_iter()
            .map(|i| match i {
                Item::Text(t) => Ok(t),
                _ => Err(RequestError::BadPromptType),
            })
            .collect::<Result<_, _>>()
            .map(Prompt::TextBatch),
        Item::Id(_) | Item::BadId => {
            let mut ids = Vec::with_capacity(items.len());
            for item in items {
                match item {
                    Item::Id(id) => ids.push(id),
                    Item::BadId => return Err(RequestError::BadTokenId),
                    _ => return Err(RequestError::BadPromptType),
                }
            }
            Ok(Prompt::Tokens(ids))
        }
        Item::Ids(_) => {
            let mut batch = Vec::with_capacity(items.len());
            for item in items {
                match item {
                    Item::Ids(ids) if ids.is_empty() => return Err(RequestError::EmptyPrompt),
                    Item::Ids(ids) => batch.push(ids),
                    Item::BadId => return Err(RequestError::BadTokenId),
                    _ => return Err(RequestError::BadPromptType),
                }
            }
            Ok(Prompt::TokensBatch(batch))
        }
        Item::Other => Err(RequestError::BadPromptType),
    }
}

/// A u64/i64/f64 as a token id, or `None` when out of `0..2^32` or fractional.
fn token_id_u64(v: u64) -> Option<u32> {
    u32::try_from(v).ok()
}

impl<'de> Deserialize<'de> for Item<'de> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ItemVisitor;
        impl<'de> Visitor<'de> for ItemVisitor {
            type Value = Item<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a prompt element")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Item<'de>, E> {
                Ok(Item::Text(Cow::Borrowed(v)))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Item<'de>, E> {
                Ok(Item::Text(Cow::Owned(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Item<'de>, E> {
                Ok(Item::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Item<'de>, E> {
                Ok(token_id_u64(v).map_or(Item::BadId, Item::Id))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Item<'de>, E> {
                Ok(u64::try_from(v).ok().and_then(token_id_u64).map_or(Item::BadId, Item::Id))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Item<'de>, E> {
                Ok(Item::BadId)
            }
            fn visit_unit<E: de::Error>(self) -> Result<Item<'de>, E> {
                Ok(Item::Other)
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Item<'de>, E> {
                Ok(Item::Other)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Item<'de>, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Item::Other)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Item<'de>, A::Error> {
                let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0));
                let mut verdict = None;
                while let Some(item) = seq.next_element::<Item<'de>>()? {
                    match item {
                        Item::Id(id) => ids.push(id),
                        Item::BadId => verdict = verdict.or(Some(Item::BadId)),
                        _ => verdict = Some(Item::Other),
                    }
                }
                Ok(verdict.unwrap_or(Item::Ids(ids)))
            }
        }
        d.deserialize_any(ItemVisitor)
    }
}

// ---- messages -----------------------------------------------------------------------------

/// What one message parsed to, without failing the parse.
enum MessageResult<'a> {
    Ok(Message<'a>),
    Problem(MessageProblem),
    Unsupported(String),
}

fn parse_messages<'a>(raw: &'a RawValue) -> Result<Vec<Message<'a>>, RequestError> {
    let not_array = || RequestError::InvalidField { param: "messages", expected: "an array of messages" };
    if !raw.get().starts_with('[') {
        return Err(not_array());
    }
    let results: Vec<MessageResult<'a>> = serde_json::from_str(raw.get()).map_err(|_| not_array())?;
    if results.is_empty() {
        return Err(RequestError::EmptyMessages);
    }
    results
        .into_iter()
        .enumerate()
        .map(|(index, r)| match r {
            MessageResult::Ok(m) => Ok(m),
            MessageResult::Problem(problem) => Err(RequestError::InvalidMessage { index, problem }),
            MessageResult::Unsupported(part_type) => {
                Err(RequestError::UnsupportedContentPart { index, part_type })
            }
        })
        .collect()
}

/// A JSON value seen only as "a string" or "something else" (drained).
enum MaybeStr<'a> {
    Str(Cow<'a, str>),
    Null,
    Other,
}

impl<'de: 'a, 'a> Deserialize<'de> for MaybeStr<'a> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match <&'de RawValue>::deserialize(d)? {
            raw if raw.get() == "null" => Ok(MaybeStr::Null),
            raw if raw.get().starts_with('"') => serde_json::from_str::<Str<'de>>(raw.get())
                .map(|s| MaybeStr::Str(s.0))
                .map_err(de::Error::custom),
            _ => Ok(MaybeStr::Other),
        }
    }
}

/// `content`: null, a string, or a list of parts.
enum Content<'a> {
    Null,
    Text(Cow<'a, str>),
    Parts(Result<Vec<Cow<'a, str>>, MessageResult<'a>>),
    Bad,
}

#[derive(Deserialize)]
struct RawPart<'a> {
    #[serde(borrow, rename = "type")]
    kind: Option<MaybeStr<'a>>,
    #[serde(borrow)]
    text: Option<MaybeStr<'a>>,
}

impl<'de> Deserialize<'de> for Content<'de> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = <&'de RawValue>::deserialize(d)?;
        let s = raw.get();
        if s == "null" {
            return Ok(Content::Null);
        }
        if s.starts_with('"') {
            return serde_json::from_str::<Str<'de>>(s)
                .map(|t| Content::Text(t.0))
                .map_err(de::Error::custom);
        }
        if !s.starts_with('[') {
            return Ok(Content::Bad);
        }
        let parts: Vec<&'de RawValue> = serde_json::from_str(s).map_err(de::Error::custom)?;
        let mut texts = Vec::with_capacity(parts.len());
        for part in parts {
            let bad = || Ok(Content::Parts(Err(MessageResult::Problem(MessageProblem::BadContentPart))));
            if !part.get().starts_with('{') {
                return bad();
            }
            let part: RawPart<'de> = serde_json::from_str(part.get()).map_err(de::Error::custom)?;
            match (part.kind, part.text) {
                (Some(MaybeStr::Str(kind)), Some(MaybeStr::Str(text))) if kind == "text" => texts.push(text),
                (Some(MaybeStr::Str(kind)), _) if kind == "text" => return bad(),
                (Some(MaybeStr::Str(kind)), _) => {
                    return Ok(Content::Parts(Err(MessageResult::Unsupported(kind.into_owned()))));
                }
                _ => return bad(),
            }
        }
        Ok(Content::Parts(Ok(texts)))
    }
}

impl<'de> Deserialize<'de> for MessageResult<'de> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct MessageVisitor;
        impl<'de> Visitor<'de> for MessageVisitor {
            type Value = MessageResult<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a chat message")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut role = None;
                let mut content = Content::Null;
                let mut extra = Vec::new();
                while let Some(Str(key)) = map.next_key::<Str<'de>>()? {
                    match &*key {
                        "role" => role = Some(map.next_value::<MaybeStr<'de>>()?),
                        "content" => content = map.next_value::<Content<'de>>()?,
                        _ => extra.push((key, map.next_value::<&'de RawValue>()?)),
                    }
                }
                let role = match role {
                    None | Some(MaybeStr::Null) => {
                        return Ok(MessageResult::Problem(MessageProblem::MissingRole));
                    }
                    Some(MaybeStr::Other) => return Ok(MessageResult::Problem(MessageProblem::BadRole)),
                    Some(MaybeStr::Str(r)) => r,
                };
                let content = match content {
                    Content::Null => None,
                    Content::Text(t) => Some(t),
                    Content::Parts(Ok(texts)) => Some(join_text_parts(texts)),
                    Content::Parts(Err(problem)) => return Ok(problem),
                    Content::Bad => return Ok(MessageResult::Problem(MessageProblem::BadContent)),
                };
                Ok(MessageResult::Ok(Message { role, content, extra }))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(MessageResult::Problem(MessageProblem::NotAnObject))
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
                Ok(MessageResult::Problem(MessageProblem::NotAnObject))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
                Ok(MessageResult::Problem(MessageProblem::NotAnObject))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
                Ok(MessageResult::Problem(MessageProblem::NotAnObject))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
                Ok(MessageResult::Problem(MessageProblem::NotAnObject))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
                Ok(MessageResult::Problem(MessageProblem::NotAnObject))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(MessageResult::Problem(MessageProblem::NotAnObject))
            }
        }
        d.deserialize_any(MessageVisitor)
    }
}

/// vLLM's "string" content format: text parts joined with a newline.
fn join_text_parts(mut texts: Vec<Cow<'_, str>>) -> Cow<'_, str> {
    if texts.len() == 1 {
        return texts.pop().unwrap_or_default();
    }
    Cow::Owned(texts.join("\n"))
}

#[cfg(test)]
#[path = "request/tests.rs"]
mod tests;
