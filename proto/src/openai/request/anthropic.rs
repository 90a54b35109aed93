//! Anthropic's Messages API (`POST /v1/messages`) as vLLM serves it: a Messages request
//! becomes the chat completion request vLLM turns it into before rendering it with the
//! model's chat template (`vllm/entrypoints/anthropic/serving.py` and `inline_system.py`,
//! 2026), so the router and the replica agent compute the prompt vLLM will.
//! [`chat_body`] writes that request as JSON, for [`super::ChatRequest::parse`].
//!
//! The conversion, in vLLM's order:
//!
//! 1. **System prompt.** `system` is a string (as it is) or text blocks (their non-empty
//!    texts joined with nothing between them, a block that starts with
//!    `x-anthropic-billing-header` left out: Claude Code's per-request attribution, which would
//!    defeat prefix caching). System messages that lead `messages` are appended to it, each
//!    joined with a blank line; the result is the first message, `role: "system"`.
//! 2. **Inline system messages** (later `role: "system"` messages, which Claude Code sends):
//!    first moved past the tool results that answer an assistant's `tool_use`; then, in
//!    [`InlineSystem::Preserve`] mode and when there is a system prompt, kept in place as
//!    system messages, else folded into the neighbouring user text (see `fold`). vLLM
//!    chooses the mode by probing the model's template once (its default, "auto");
//!    [`inline_system_mode`] runs the same probe on the router's template, on the rendered
//!    text where vLLM compares token ids. (A router that tokenizes through its replicas does
//!    not have their template: it asks again with the messages folded when a replica refuses
//!    them in place, `router/src/proxy/route.rs`.)
//! 3. **Content blocks.** A string stays a string. Of a list of blocks: non-empty `text`
//!    blocks become text parts (one alone becomes a string; several are joined with `"\n"` by
//!    the chat parser, as vLLM's string content format joins them); `image` becomes an
//!    `image_url` part (media: the prompt is hashed up to that message); `thinking` becomes
//!    the message's `reasoning` (texts joined with nothing); `redacted_thinking` and
//!    `tool_reference` are dropped; `tool_use` becomes a tool call whose `arguments` is the
//!    `input` object (`{}` when absent), for gpt-oss as vLLM writes it, `json.dumps`
//!    (Harmony writes it as it is; a chat template parses it again); a user's `tool_result` becomes a `role: "tool"`
//!    message placed *before* the user message (its text items joined with `"\n"`; its images
//!    a user message of `image_url` parts after it; its `tool_reference` items another tool
//!    message, of `{"type": "tool_reference", "name"}` parts); an assistant's `tool_result` becomes the
//!    text `Tool result: {content}` (a list there is written by Python's `str()`, which is
//!    not reproduced: that message counts as media). A user message left with no content is
//!    dropped.
//! 4. **Tools.** `{name, description, input_schema}` becomes `{"type": "function",
//!    "function": {"name", "description" (null when absent), "parameters" (the schema, with
//!    `"type": "object"` added at its end when it has no `type`), "strict" and
//!    "defer_loading" (when set)}}`.
//! 5. **The rest.** `model`, `max_tokens` (required), `stream`, `cache_salt` and
//!    `chat_template_kwargs` are carried over; `output_config.effort` becomes
//!    `reasoning_effort`, and `thinking: {"type": "disabled"}` makes it `"none"` (vLLM may
//!    probe for `"low"` instead, for a template that ignores `"none"`). Sampling fields do not
//!    change the prompt and are left out. A message's role `ctx` or `msg` (Claude Code's) is
//!    `user`.
//!
//! What is read is validated as vLLM's request model validates it, each problem a
//! [`RequestError`] naming the field at fault; unknown fields and block types are skipped.
//! Texts go through as the JSON strings they were written as (`text.rs`), and a well-formed
//! body is read in one pass (`read_request`): the conversion costs a fraction of what
//! tokenizing the prompt does (`proto/benches/messages.rs`).

use std::borrow::Cow;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use self::text::Text;
use super::BILLING_HEADER;
use super::{Str, object, parse_object};
use crate::openai::ChatTemplate;
use crate::openai::error::{MessageProblem, RequestError};

/// The path of the Messages API.
pub const MESSAGES_PATH: &str = "/v1/messages";

/// Where inline system messages go (module docs, step 2).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum InlineSystem {
    /// Kept in place, when the request has a system prompt.
    #[default]
    Preserve,
    /// Folded into the neighbouring user text.
    Fold,
}

/// The chat completion request, as JSON, that vLLM makes of the Messages request `body`, for a
/// model whose chats are rendered with Harmony (gpt-oss) if `harmony`.
pub fn chat_body(body: &[u8], inline: InlineSystem, harmony: bool) -> Result<Vec<u8>, RequestError> {
    let (fields, messages) = read_request(body)?;
    let Fields {
        model,
        system,
        max_tokens,
        stream,
        cache_salt,
        chat_template_kwargs,
        tools,
        thinking,
        output_config,
        tool_choice,
        ..
    } = fields;
    let max_tokens = max_tokens.ok_or(RequestError::MissingField { param: "max_tokens" })?;
    let system = system_prompt(system)?;

    let (leading, rest) = place_inline_system(messages, !system.is_empty(), inline);
    let mut out = Vec::new();
    let system = if leading.is_empty() { system } else { Text::join_paragraphs([&system, &leading]) };
    if !system.is_empty() {
        out.push(OutMessage::text(Role::System, system));
    }
    for message in rest {
        convert(message, harmony, &mut out)?;
    }
    let body = ChatBody {
        model,
        messages: out,
        max_tokens,
        stream,
        cache_salt,
        chat_template_kwargs,
        tools: tools.map(convert_tools).transpose()?,
        tool_choice: tool_choice_none(tool_choice),
        reasoning_effort: reasoning_effort(thinking, output_config)?,
    };
    // Strings, raw JSON and options only: serializing into a Vec cannot fail.
    Ok(serde_json::to_vec(&body).unwrap_or_default())
}

/// What the conversion reads of a Messages request ([`read_request`]); `messages` are taken
/// out for [`read_messages`].
#[derive(Deserialize)]
struct Fields<'a> {
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    #[serde(borrow)]
    messages: Option<Vec<FastMessage<'a>>>,
    #[serde(borrow)]
    system: Option<&'a RawValue>,
    #[serde(borrow)]
    max_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    stream: Option<&'a RawValue>,
    #[serde(borrow)]
    cache_salt: Option<&'a RawValue>,
    #[serde(borrow)]
    chat_template_kwargs: Option<&'a RawValue>,
    #[serde(borrow)]
    tools: Option<&'a RawValue>,
    #[serde(borrow)]
    thinking: Option<&'a RawValue>,
    #[serde(borrow)]
    output_config: Option<&'a RawValue>,
    #[serde(borrow)]
    tool_choice: Option<&'a RawValue>,
}

/// A message's `role` and `content`: an object only (see [`object::fields_of`]).
struct FastMessage<'a>([Option<&'a RawValue>; 2]);

impl<'de: 'a, 'a> Deserialize<'de> for FastMessage<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        object::fields_of(d, &["role", "content"]).map(FastMessage)
    }
}

/// The request's fields and messages, in one pass over the body where it reads as
/// [`Fields`] (messages and their fields included: a long prompt is read past once here, not
/// once a level); a body that does not (a repeated key, a field of another type) is read
/// again field by field ([`parse_object`]), which takes a repeated key's last value as vLLM
/// does and says what is wrong, if anything is.
fn read_request(body: &[u8]) -> Result<(Fields<'_>, Vec<Message<'_>>), RequestError> {
    // (A derived reading takes an array for a struct, field by field: only an object here.)
    let object = body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
    if let Some(mut fields) = object.then(|| serde_json::from_slice::<Fields<'_>>(body).ok()).flatten() {
        let messages = fields.messages.take().ok_or(RequestError::MissingField { param: "messages" })?;
        let each = messages.into_iter().map(|FastMessage([role, content])| Ok((role, content)));
        return Ok((fields, read_messages(each)?));
    }
    const FIELDS: [&str; 11] = [
        "model",
        "messages",
        "system",
        "max_tokens",
        "stream",
        "cache_salt",
        "chat_template_kwargs",
        "tools",
        "thinking",
        "output_config",
        "tool_choice",
    ];
    let [
        model,
        messages,
        system,
        max_tokens,
        stream,
        cache_salt,
        chat_template_kwargs,
        tools,
        thinking,
        output_config,
        tool_choice,
    ] = parse_object(body, &FIELDS)?;
    let messages = messages.ok_or(RequestError::MissingField { param: "messages" })?;
    let not_array = || RequestError::InvalidField { param: "messages", expected: "an array of messages" };
    if !messages.get().starts_with('[') {
        return Err(not_array());
    }
    let items: Vec<&RawValue> = serde_json::from_str(messages.get()).map_err(|_| not_array())?;
    let each = items.into_iter().enumerate().map(|(index, raw)| {
        if !raw.get().starts_with('{') {
            return Err(RequestError::InvalidMessage { index, problem: MessageProblem::NotAnObject });
        }
        let [role, content] =
            object::fields(raw.get().as_bytes(), &["role", "content"]).map_err(RequestError::Json)?;
        Ok((role, content))
    });
    let messages = read_messages(each)?;
    let fields = Fields {
        model,
        messages: None,
        system,
        max_tokens,
        stream,
        cache_salt,
        chat_template_kwargs,
        tools,
        thinking,
        output_config,
        tool_choice,
    };
    Ok((fields, messages))
}

/// The messages from each one's `role` and `content`.
fn read_messages<'a>(
    fields: impl ExactSizeIterator<Item = Result<(Option<&'a RawValue>, Option<&'a RawValue>), RequestError>>,
) -> Result<Vec<Message<'a>>, RequestError> {
    if fields.len() == 0 {
        return Err(RequestError::EmptyMessages);
    }
    fields
        .enumerate()
        .map(|(index, fields)| fields.and_then(|(role, content)| read_message(index, role, content)))
        .collect()
}

/// The chat completion request written out.
#[derive(Serialize)]
struct ChatBody<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    model: Option<&'a RawValue>,
    messages: Vec<OutMessage<'a>>,
    max_tokens: &'a RawValue,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_salt: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    chat_template_kwargs: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tools: Option<Vec<Tool<'a>>>,
    /// `"none"` for `{"type": "none"}` (what `--exclude-tools-when-tool-choice-none` reads;
    /// vLLM makes the other choices OpenAI's too, which the prompt does not show).
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_effort: Option<Cow<'a, str>>,
}

/// `Some("none")` for a `tool_choice` of type `none`.
fn tool_choice_none(raw: Option<&RawValue>) -> Option<&'static str> {
    let [kind] = object::fields(raw?.get().as_bytes(), &["type"]).ok()?;
    (kind?.get() == r#""none""#).then_some("none")
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Role {
    System,
    User,
    Assistant,
    Tool,
}

/// One message of the request, parsed.
#[derive(Debug)]
struct Message<'a> {
    role: Role,
    content: Content<'a>,
}

#[derive(Debug)]
enum Content<'a> {
    Text(Text<'a>),
    Blocks(Vec<Block<'a>>),
}

/// A content block: the fields vLLM reads of it.
#[derive(Debug, Clone)]
enum Block<'a> {
    Text(Text<'a>),
    Image(String),
    Thinking(Text<'a>),
    ToolUse {
        id: Option<Cow<'a, str>>,
        name: Cow<'a, str>,
        input: Option<&'a RawValue>,
    },
    ToolResult {
        tool_use_id: Cow<'a, str>,
        content: ToolResult<'a>,
    },
    /// A block that adds nothing to the prompt (`redacted_thinking`, `tool_reference`, types
    /// vLLM skips).
    Skipped,
}

/// A `tool_result`'s content.
#[derive(Debug, Clone)]
enum ToolResult<'a> {
    None,
    Text(Text<'a>),
    Items(Vec<Item<'a>>),
}

/// An item of a `tool_result`'s content list.
#[derive(Debug, Clone)]
enum Item<'a> {
    Text(Text<'a>),
    Image(String),
    Reference(Cow<'a, str>),
    Other,
}

fn read_message<'a>(
    index: usize,
    role: Option<&'a RawValue>,
    content: Option<&'a RawValue>,
) -> Result<Message<'a>, RequestError> {
    let problem = |problem| RequestError::InvalidMessage { index, problem };
    let role = match string(role.ok_or(problem(MessageProblem::MissingRole))?) {
        Some(role) => role,
        None => return Err(problem(MessageProblem::BadRole)),
    };
    let role = match role.as_ref() {
        // Claude Code (2.1.154 on) sends `ctx` and `msg` turns, which vLLM reads as the user's.
        "user" | "ctx" | "msg" => Role::User,
        "assistant" => Role::Assistant,
        "system" => Role::System,
        _ => {
            return Err(RequestError::InvalidAt {
                at: format!("messages[{index}].role"),
                expected: "\"user\", \"assistant\" or \"system\"",
            });
        }
    };
    let at = || format!("messages[{index}].content");
    let content = content.ok_or_else(|| RequestError::InvalidAt { at: at(), expected: BLOCKS })?;
    Ok(Message { role, content: parse_content(content, &at)? })
}

const BLOCKS: &str = "a string or an array of content blocks";

/// A content block's [`BLOCK_FIELDS`], read in one pass over the content (see
/// [`read_request`]): an object only.
struct FastBlock<'a>([Option<&'a RawValue>; 9]);

impl<'de: 'a, 'a> Deserialize<'de> for FastBlock<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        object::fields_of(d, &BLOCK_FIELDS).map(FastBlock)
    }
}

/// The fields [`block`] reads, in its order.
const BLOCK_FIELDS: [&str; 9] =
    ["type", "text", "source", "id", "name", "input", "content", "tool_use_id", "thinking"];

fn parse_content<'a>(raw: &'a RawValue, at: &dyn Fn() -> String) -> Result<Content<'a>, RequestError> {
    if let Some(text) = Text::of(raw) {
        return Ok(Content::Text(text));
    }
    let invalid = || RequestError::InvalidAt { at: at(), expected: BLOCKS };
    if !raw.get().starts_with('[') {
        return Err(invalid());
    }
    let at = |i: usize| format!("{}[{i}]", at());
    if let Ok(fast) = serde_json::from_str::<Vec<FastBlock<'a>>>(raw.get()) {
        let blocks = fast.into_iter().enumerate().map(|(i, FastBlock(fields))| block(fields, &|| at(i)));
        return Ok(Content::Blocks(blocks.collect::<Result<_, _>>()?));
    }
    let items: Vec<&RawValue> = serde_json::from_str(raw.get()).map_err(|_| invalid())?;
    let blocks = items.into_iter().enumerate().map(|(i, raw)| {
        if !raw.get().starts_with('{') {
            return Err(RequestError::InvalidAt { at: at(i), expected: "a content block object" });
        }
        block(object::fields(raw.get().as_bytes(), &BLOCK_FIELDS).map_err(RequestError::Json)?, &|| at(i))
    });
    Ok(Content::Blocks(blocks.collect::<Result<_, _>>()?))
}

/// A content block from its [`BLOCK_FIELDS`]; `at` names it in errors.
fn block<'a>(fields: [Option<&'a RawValue>; 9], at: &dyn Fn() -> String) -> Result<Block<'a>, RequestError> {
    let bad = |field: &str, expected| RequestError::InvalidAt { at: format!("{}{field}", at()), expected };
    let [kind, text, source, id, name, input, content, tool_use_id, thinking] = fields;
    let kind = kind.and_then(string).ok_or_else(|| bad(".type", "a string"))?;
    // A string field: absent or null is `None`, any other type an error.
    let text_of = |raw: Option<&'a RawValue>, field: &str| match raw {
        None => Ok(None),
        Some(raw) => string(raw).map(Some).ok_or_else(|| bad(field, "a string")),
    };
    // A long text: kept as written.
    let long_text = |raw: Option<&'a RawValue>, field: &str| match raw {
        None => Ok(None),
        Some(raw) => Text::of(raw).map(Some).ok_or_else(|| bad(field, "a string")),
    };
    Ok(match kind.as_ref() {
        "text" => Block::Text(long_text(text, ".text")?.unwrap_or_default()),
        // An empty source is no image, as vLLM reads it.
        "image" => match source.filter(|s| s.get() != "null") {
            Some(source) if !source.get().starts_with('{') => return Err(bad(".source", "an object")),
            Some(source) if is_empty_object(source) => Block::Skipped,
            Some(source) => Block::Image(image_url(source)),
            None => Block::Skipped,
        },
        "thinking" => match long_text(thinking, ".thinking")? {
            Some(thinking) => Block::Thinking(thinking),
            None => Block::Skipped,
        },
        "tool_use" => {
            if input.is_some_and(|i| !i.get().starts_with('{')) {
                return Err(bad(".input", "an object"));
            }
            Block::ToolUse {
                id: text_of(id, ".id")?,
                name: text_of(name, ".name")?.unwrap_or_default(),
                input,
            }
        }
        "tool_result" => Block::ToolResult {
            tool_use_id: text_of(tool_use_id, ".tool_use_id")?.unwrap_or_default(),
            content: parse_tool_result(content, &format!("{}.content", at()))?,
        },
        _ => Block::Skipped,
    })
}

fn parse_tool_result<'a>(raw: Option<&'a RawValue>, at: &str) -> Result<ToolResult<'a>, RequestError> {
    let invalid =
        || RequestError::InvalidAt { at: at.to_owned(), expected: "a string or an array of objects" };
    let Some(raw) = raw else { return Ok(ToolResult::None) };
    if let Some(text) = Text::of(raw) {
        return Ok(ToolResult::Text(text));
    }
    if !raw.get().starts_with('[') {
        return Err(invalid());
    }
    let items: Vec<&RawValue> = serde_json::from_str(raw.get()).map_err(|_| invalid())?;
    let mut out = Vec::with_capacity(items.len());
    for raw in items {
        if !raw.get().starts_with('{') {
            return Err(invalid());
        }
        let [kind, text, source, tool_name, name] =
            object::fields(raw.get().as_bytes(), &["type", "text", "source", "tool_name", "name"])
                .map_err(RequestError::Json)?;
        // As vLLM reads these items (plain dicts): a missing or odd field is a default.
        let text_field = |raw: Option<&'a RawValue>| raw.and_then(string);
        out.push(match kind.and_then(string).as_deref() {
            Some("text") => Item::Text(text.and_then(Text::of).unwrap_or_default()),
            // A missing source is an empty one: a data URL with no data, as vLLM makes it.
            Some("image") => {
                Item::Image(source.map_or_else(|| "data:image/jpeg;base64,".to_owned(), image_url))
            }
            Some("tool_reference") => {
                match text_field(tool_name).filter(|n| !n.is_empty()).or_else(|| text_field(name)) {
                    Some(name) if !name.is_empty() => Item::Reference(name),
                    _ => Item::Other,
                }
            }
            _ => Item::Other,
        });
    }
    Ok(ToolResult::Items(out))
}

/// Whether `raw` is an object with no keys.
fn is_empty_object(raw: &RawValue) -> bool {
    raw.get().strip_prefix('{').and_then(|r| r.strip_suffix('}')).is_some_and(|r| r.trim().is_empty())
}

/// An image `source` as the URL vLLM makes of it: a `url` source's URL, else a data URL.
fn image_url(source: &RawValue) -> String {
    fn text(raw: Option<&RawValue>) -> Option<Cow<'_, str>> {
        raw.and_then(string)
    }
    let Ok([kind, url, media_type, data]) =
        object::fields(source.get().as_bytes(), &["type", "url", "media_type", "data"])
    else {
        return String::new();
    };
    if text(kind).as_deref() == Some("url") {
        return text(url).unwrap_or_default().into_owned();
    }
    let media_type = text(media_type).unwrap_or(Cow::Borrowed("image/jpeg"));
    format!("data:{media_type};base64,{}", text(data).unwrap_or_default())
}

/// A JSON string's value, if `raw` is one.
fn string(raw: &RawValue) -> Option<Cow<'_, str>> {
    raw.get().starts_with('"').then(|| serde_json::from_str::<Str<'_>>(raw.get()).ok()).flatten().map(|s| s.0)
}

/// The top-level `system`: a string as it is, or its text blocks' text.
fn system_prompt(raw: Option<&RawValue>) -> Result<Text<'_>, RequestError> {
    let Some(raw) = raw else { return Ok(Text::default()) };
    match parse_content(raw, &|| "system".to_owned()) {
        Ok(Content::Text(text)) => Ok(text),
        Ok(Content::Blocks(blocks)) => Ok(blocks_text(&blocks)),
        Err(_) => Err(RequestError::InvalidField {
            param: "system",
            expected: "a string or an array of text blocks",
        }),
    }
}

/// Text blocks' non-empty texts joined with nothing, the billing header left out.
fn blocks_text<'a>(blocks: &[Block<'a>]) -> Text<'a> {
    let texts = blocks.iter().filter_map(|b| match b {
        Block::Text(text) if !text.is_empty() && !text.starts_with(BILLING_HEADER) => Some(text),
        _ => None,
    });
    Text::join(texts, "")
}

/// A system message's text, the billing header left out.
fn system_text<'a>(message: &Message<'a>) -> Text<'a> {
    match &message.content {
        Content::Text(text) if text.starts_with(BILLING_HEADER) => Text::default(),
        Content::Text(text) => text.clone(),
        Content::Blocks(blocks) => blocks_text(blocks),
    }
}

/// The text of the system messages that lead `messages`, and the rest placed as vLLM places
/// them (module docs, step 2); `has_system` when the request has a system prompt.
fn place_inline_system(
    messages: Vec<Message<'_>>,
    has_system: bool,
    inline: InlineSystem,
) -> (Text<'_>, Vec<Message<'_>>) {
    if messages.iter().all(|m| m.role != Role::System) {
        return (Text::default(), messages);
    }
    let leading = messages.iter().take_while(|m| m.role == Role::System).count();
    let mut messages = messages.into_iter();
    let texts: Vec<Text<'_>> = messages.by_ref().take(leading).map(|m| system_text(&m)).collect();
    let leading = Text::join_paragraphs(&texts);
    let rest = move_out_of_tool_runs(messages.collect());
    if inline == InlineSystem::Preserve && (has_system || !leading.is_empty()) {
        return (leading, rest);
    }
    (leading, fold(rest))
}

/// System messages between an assistant's `tool_use` and the user message with its results
/// move after that message.
fn move_out_of_tool_runs(messages: Vec<Message<'_>>) -> Vec<Message<'_>> {
    let mut out = Vec::with_capacity(messages.len());
    let mut held = Vec::new();
    let mut awaiting_results = false;
    for message in messages {
        if message.role == Role::System {
            if awaiting_results {
                held.push(message)
            } else {
                out.push(message)
            }
            continue;
        }
        let role = message.role;
        if role == Role::Assistant {
            out.append(&mut held);
        }
        awaiting_results = role == Role::Assistant
            && matches!(&message.content, Content::Blocks(b) if b.iter().any(|b| matches!(b, Block::ToolUse { .. })));
        out.push(message);
        if role == Role::User {
            out.append(&mut held);
        }
    }
    out.append(&mut held);
    out
}

/// vLLM's `fold` mode: an inline system message's text joins the user message before it
/// (its own text, or its last tool result when it has only tool results), or the next user
/// message's start, or becomes a user message of its own after an assistant turn.
fn fold(messages: Vec<Message<'_>>) -> Vec<Message<'_>> {
    let mut out: Vec<Message<'_>> = Vec::with_capacity(messages.len());
    let mut pending: Vec<Text<'_>> = Vec::new();
    for mut message in messages {
        if message.role == Role::System {
            let text = system_text(&message);
            if text.is_empty() {
                continue;
            }
            match out.last_mut() {
                Some(last) if last.role == Role::User && pending.is_empty() => append_to_user(last, text),
                _ => pending.push(text),
            }
            continue;
        }
        if !pending.is_empty() {
            let text = Text::join_paragraphs(&pending);
            pending.clear();
            if message.role == Role::User {
                message.content = add_text(message.content, text, false);
            } else {
                out.push(Message { role: Role::User, content: Content::Text(text) });
            }
        }
        out.push(message);
    }
    if !pending.is_empty() {
        out.push(Message { role: Role::User, content: Content::Text(Text::join_paragraphs(&pending)) });
    }
    out
}

/// `old` and `text` in that order (`text` first unless `at_end`), joined with a blank line.
fn paragraphs<'a>(old: &Text<'a>, text: &Text<'a>, at_end: bool) -> Text<'a> {
    if at_end { Text::join_paragraphs([old, text]) } else { Text::join_paragraphs([text, old]) }
}

/// Joins `text` onto the text at one end of `content`: into the end text block, or as a new
/// text block.
fn add_text<'a>(content: Content<'a>, text: Text<'a>, at_end: bool) -> Content<'a> {
    match content {
        Content::Text(old) => Content::Text(paragraphs(&old, &text, at_end)),
        Content::Blocks(mut blocks) => {
            add_text_block(&mut blocks, text, at_end);
            Content::Blocks(blocks)
        }
    }
}

/// [`add_text`] for a list of blocks.
fn add_text_block<'a>(blocks: &mut Vec<Block<'a>>, text: Text<'a>, at_end: bool) {
    let end = if at_end { blocks.len().checked_sub(1) } else { (!blocks.is_empty()).then_some(0) };
    match end.map(|i| (i, &blocks[i])) {
        Some((i, Block::Text(old))) => blocks[i] = Block::Text(paragraphs(old, &text, at_end)),
        _ if at_end => blocks.push(Block::Text(text)),
        _ => blocks.insert(0, Block::Text(text)),
    }
}

/// Appends `text` to a user message's own text or, when it has only tool results, to the
/// last of them.
fn append_to_user<'a>(message: &mut Message<'a>, text: Text<'a>) {
    let content = std::mem::replace(&mut message.content, Content::Blocks(Vec::new()));
    message.content = match content {
        Content::Blocks(mut blocks)
            if !blocks.is_empty() && blocks.iter().all(|b| matches!(b, Block::ToolResult { .. })) =>
        {
            if let Some(Block::ToolResult { content, .. }) = blocks.last_mut() {
                *content = match std::mem::replace(content, ToolResult::None) {
                    ToolResult::None => ToolResult::Text(text),
                    ToolResult::Text(old) => ToolResult::Text(paragraphs(&old, &text, true)),
                    ToolResult::Items(mut items) => {
                        match items.last_mut() {
                            Some(Item::Text(old)) => *old = paragraphs(old, &text, true),
                            _ => items.push(Item::Text(text)),
                        }
                        ToolResult::Items(items)
                    }
                };
            }
            Content::Blocks(blocks)
        }
        Content::Text(old) => add_text(Content::Text(old), text, true),
        Content::Blocks(blocks) => {
            let (mut blocks, mut own): (Vec<_>, Vec<_>) =
                blocks.into_iter().partition(|b| matches!(b, Block::ToolResult { .. }));
            add_text_block(&mut own, text, true);
            blocks.append(&mut own);
            Content::Blocks(blocks)
        }
    };
}

/// A chat message written out.
#[derive(Serialize)]
struct OutMessage<'a> {
    role: Role,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<OutContent<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning: Option<Text<'a>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<ToolCall<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_call_id: Option<Cow<'a, str>>,
}

impl<'a> OutMessage<'a> {
    fn text(role: Role, text: Text<'a>) -> Self {
        OutMessage {
            role,
            content: Some(OutContent::Text(text)),
            reasoning: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
}

#[derive(Serialize)]
#[serde(untagged)]
enum OutContent<'a> {
    Text(Text<'a>),
    Parts(Vec<Part<'a>>),
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Part<'a> {
    Text {
        text: Text<'a>,
    },
    ImageUrl {
        image_url: Url,
    },
    ToolReference {
        name: Cow<'a, str>,
    },
    /// Text vLLM writes with Python's `str()` of a JSON value, which is not reproduced: a part
    /// the chat parser takes for media, so the prompt is hashed up to its message.
    PythonRepr,
}

#[derive(Serialize)]
struct Url {
    url: String,
}

#[derive(Serialize)]
struct ToolCall<'a> {
    id: Cow<'a, str>,
    #[serde(rename = "type")]
    kind: &'static str,
    function: Function<'a>,
}

#[derive(Serialize)]
struct Function<'a> {
    name: Cow<'a, str>,
    /// The `input` object's JSON: as written (a chat template parses it again, so its
    /// spacing is irrelevant and its key order is kept), or for Harmony, which writes it as
    /// it is, as vLLM's `json.dumps` writes it.
    arguments: Cow<'a, str>,
}

/// Appends what vLLM makes of `message` to `out` (module docs, step 3).
fn convert<'a>(
    message: Message<'a>,
    harmony: bool,
    out: &mut Vec<OutMessage<'a>>,
) -> Result<(), RequestError> {
    let role = message.role;
    if role == Role::System {
        let text = system_text(&message);
        if !text.is_empty() {
            out.push(OutMessage::text(Role::System, text));
        }
        return Ok(());
    }
    let blocks = match message.content {
        Content::Text(text) => {
            out.push(OutMessage::text(role, text));
            return Ok(());
        }
        Content::Blocks(blocks) => blocks,
    };
    let mut parts = Vec::new();
    let mut tool_calls = Vec::new();
    let mut reasoning: Option<Vec<Text<'a>>> = None;
    for block in blocks {
        match block {
            Block::Text(text) if !text.is_empty() => parts.push(Part::Text { text }),
            Block::Text(_) | Block::Skipped => {}
            Block::Image(url) => parts.push(Part::ImageUrl { image_url: Url { url } }),
            Block::Thinking(text) => reasoning.get_or_insert_default().push(text),
            Block::ToolUse { id, name, input } => tool_calls.push(ToolCall {
                id: id
                    .filter(|id| !id.is_empty())
                    .unwrap_or_else(|| Cow::Owned(format!("call_{}", unix_now()))),
                kind: "function",
                function: Function { name, arguments: tool_arguments(input, harmony) },
            }),
            Block::ToolResult { tool_use_id, content } if role == Role::User => {
                tool_result_messages(tool_use_id, content, out);
            }
            Block::ToolResult { content, .. } => parts.push(match content {
                ToolResult::None => Part::Text { text: Text::plain("Tool result: ") },
                ToolResult::Text(text) => Part::Text { text: text.after("Tool result: ") },
                ToolResult::Items(items) if items.is_empty() => {
                    Part::Text { text: Text::plain("Tool result: ") }
                }
                ToolResult::Items(_) => Part::PythonRepr,
            }),
        }
    }
    let content = match parts.len() {
        0 => None,
        1 if matches!(parts[0], Part::Text { .. }) => match parts.pop() {
            Some(Part::Text { text }) => Some(OutContent::Text(text)),
            _ => None,
        },
        _ => Some(OutContent::Parts(parts)),
    };
    if role == Role::User && content.is_none() {
        return Ok(());
    }
    let reasoning = reasoning.map(|texts| Text::join(&texts, ""));
    out.push(OutMessage { role, content, reasoning, tool_calls, tool_call_id: None });
    Ok(())
}

/// A user's `tool_result`: a tool message, then its images as a user message, then its tool
/// references as another tool message.
fn tool_result_messages<'a>(
    tool_use_id: Cow<'a, str>,
    content: ToolResult<'a>,
    out: &mut Vec<OutMessage<'a>>,
) {
    let (text, images, references) = match content {
        ToolResult::None => (Text::default(), Vec::new(), Vec::new()),
        ToolResult::Text(text) => (text, Vec::new(), Vec::new()),
        ToolResult::Items(items) => {
            let (mut texts, mut images, mut references) = (Vec::new(), Vec::new(), Vec::new());
            for item in items {
                match item {
                    Item::Text(text) => texts.push(text),
                    Item::Image(url) if !url.is_empty() => {
                        images.push(Part::ImageUrl { image_url: Url { url } })
                    }
                    Item::Reference(name) => references.push(name),
                    Item::Image(_) | Item::Other => {}
                }
            }
            // Every text item, empty ones too, as vLLM joins them.
            (Text::join(&texts, "\n"), images, references)
        }
    };
    let message = |role, content, tool_call_id| OutMessage {
        role,
        content: Some(content),
        reasoning: None,
        tool_calls: Vec::new(),
        tool_call_id,
    };
    out.push(message(Role::Tool, OutContent::Text(text), Some(tool_use_id.clone())));
    if !images.is_empty() {
        out.push(message(Role::User, OutContent::Parts(images), None));
    }
    // As vLLM's `{"type": "tool_reference", "name"}` parts, for the template to expand.
    if !references.is_empty() {
        let references = references.into_iter().map(|name| Part::ToolReference { name }).collect();
        out.push(message(Role::Tool, OutContent::Parts(references), Some(tool_use_id)));
    }
}

/// An OpenAI tool definition (module docs, step 4).
#[derive(Serialize)]
struct Tool<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    function: ToolFunction<'a>,
}

#[derive(Serialize)]
struct ToolFunction<'a> {
    name: Cow<'a, str>,
    description: Option<Cow<'a, str>>,
    parameters: Box<RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    strict: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    defer_loading: Option<&'a RawValue>,
}

fn convert_tools(raw: &RawValue) -> Result<Vec<Tool<'_>>, RequestError> {
    let not_array = || RequestError::InvalidField { param: "tools", expected: "an array of tools" };
    if !raw.get().starts_with('[') {
        return Err(not_array());
    }
    let items: Vec<&RawValue> = serde_json::from_str(raw.get()).map_err(|_| not_array())?;
    items
        .into_iter()
        .enumerate()
        .map(|(i, raw)| {
            let bad = |field: &str, expected| RequestError::InvalidAt {
                at: format!("tools[{i}]{field}"),
                expected,
            };
            if !raw.get().starts_with('{') {
                return Err(bad("", "a tool object"));
            }
            let [name, description, schema, strict, defer_loading] = object::fields(
                raw.get().as_bytes(),
                &["name", "description", "input_schema", "strict", "defer_loading"],
            )
            .map_err(RequestError::Json)?;
            let name = name.and_then(string).ok_or_else(|| bad(".name", "a string"))?;
            let description = match description {
                None => None,
                Some(raw) => Some(string(raw).ok_or_else(|| bad(".description", "a string"))?),
            };
            let schema = schema
                .filter(|s| s.get().starts_with('{'))
                .ok_or_else(|| bad(".input_schema", "an object"))?;
            Ok(Tool {
                kind: "function",
                function: ToolFunction {
                    name,
                    description,
                    parameters: with_object_type(schema)?,
                    strict,
                    defer_loading,
                },
            })
        })
        .collect()
}

/// `schema` with `"type": "object"` added at its end when it has no `type`.
fn with_object_type(schema: &RawValue) -> Result<Box<RawValue>, RequestError> {
    let [kind] = object::fields(schema.get().as_bytes(), &["type"]).map_err(RequestError::Json)?;
    let text = schema.get();
    let owned = match kind {
        Some(_) => text.to_owned(),
        None => {
            let inner = text[1..text.len() - 1].trim();
            if inner.is_empty() {
                r#"{"type":"object"}"#.to_owned()
            } else {
                format!(r#"{{{inner},"type":"object"}}"#)
            }
        }
    };
    RawValue::from_string(owned).map_err(RequestError::Json)
}

/// `reasoning_effort` from `output_config.effort`, overridden by `thinking: {"type":
/// "disabled"}` (`"none"`).
fn reasoning_effort<'a>(
    thinking: Option<&'a RawValue>,
    output_config: Option<&'a RawValue>,
) -> Result<Option<Cow<'a, str>>, RequestError> {
    let field = |raw: Option<&'a RawValue>,
                 param: &'static str,
                 key: &str|
     -> Result<Option<Cow<'a, str>>, RequestError> {
        let Some(raw) = raw else { return Ok(None) };
        let invalid = RequestError::InvalidField { param, expected: "an object" };
        if !raw.get().starts_with('{') {
            return Err(invalid);
        }
        let [value] = object::fields(raw.get().as_bytes(), &[key]).map_err(RequestError::Json)?;
        Ok(value.and_then(string))
    };
    let disabled = field(thinking, "thinking", "type")?.is_some_and(|t| t == "disabled");
    if disabled {
        return Ok(Some(Cow::Borrowed("none")));
    }
    field(output_config, "output_config", "effort")
}

/// vLLM's probe of a template for inline system messages: each of three conversations (one
/// mid-way, one after a tool result, one at the end) is rendered with and without an inline
/// system message, with `reasoning_effort` "high" and then none; the message may stay in
/// place only if every rendering succeeds and the message's text appears once, as a segment
/// inserted into the prompt and nothing else changed, with more than its text (a role
/// marker), not as a user message would be, before the generation prompt, and keeping
/// whatever prior reasoning the prompt kept. Any doubt folds; so does a template that cannot
/// render the conversations at all.
pub fn inline_system_mode(template: &ChatTemplate) -> InlineSystem {
    const INLINE: &str = "Echo inline note";
    const REASONING: &str = "Foxtrot prior reasoning";
    const SYSTEM: &str = r#"{"role":"system","content":"Alpha leading instructions"}"#;
    const USER: &str = r#"{"role":"user","content":"Bravo first question"}"#;
    let after_tool = format!(
        r#"{{"role":"assistant","reasoning":"{REASONING}","tool_calls":[{{"id":"probe0001","type":"function","function":{{"name":"probe_tool","arguments":"{{}}"}}}}]}}"#
    );
    let cases: [(Vec<String>, usize); 3] = [
        (
            vec![
                SYSTEM.into(),
                USER.into(),
                r#"{"role":"assistant","content":"Charlie first answer"}"#.into(),
                r#"{"role":"user","content":"Delta second question"}"#.into(),
            ],
            3,
        ),
        (
            vec![
                SYSTEM.into(),
                USER.into(),
                after_tool,
                r#"{"role":"tool","tool_call_id":"probe0001","content":"Golf output"}"#.into(),
            ],
            4,
        ),
        (vec![SYSTEM.into(), USER.into()], 2),
    ];
    let render = |messages: &[String], effort: Option<&str>| -> Option<String> {
        let effort = effort.map_or(String::new(), |e| format!(r#","reasoning_effort":"{e}""#));
        let body = format!(
            r#"{{"messages":[{}],"tools":[{{"type":"function","function":{{"name":"probe_tool","description":"Probe tool.","parameters":{{"type":"object","properties":{{}}}}}}}}]{effort}}}"#,
            messages.join(",")
        );
        let chat = super::ChatRequest::parse(body.as_bytes()).ok()?;
        template.render(&chat.messages, chat.variables()).ok()
    };
    let inserted = |messages: &[String], index: usize, message: &str| {
        let mut with = messages.to_vec();
        with.insert(index, message.to_owned());
        with
    };
    let mut evaluated: Option<Vec<String>> = None;
    for effort in [Some("high"), None] {
        let mut bases = Vec::new();
        let mut rendered = Vec::new();
        for (messages, index) in &cases {
            let mut messages = messages.clone();
            let mut base = render(&messages, effort);
            if base.is_none() && messages.iter().any(|m| m.contains(REASONING)) {
                // A template that refuses reasoning in history is probed without it.
                messages = messages
                    .iter()
                    .map(|m| m.replace(&format!(r#""reasoning":"{REASONING}","#), ""))
                    .collect();
                base = render(&messages, effort);
            }
            let Some(base) = base else { break };
            bases.push(base);
            rendered.push((messages, *index));
        }
        if bases.len() != cases.len() || evaluated.as_ref() == Some(&bases) {
            continue;
        }
        for ((messages, index), base) in rendered.iter().zip(&bases) {
            let inline = format!(r#"{{"role":"system","content":"{INLINE}"}}"#);
            let Some(new) = render(&inserted(messages, *index, &inline), effort) else {
                return InlineSystem::Fold;
            };
            let Some((position, segment)) = insertion(base, &new).filter(|_| new.contains(INLINE)) else {
                return InlineSystem::Fold;
            };
            let lands_last = *index == messages.len() && position >= base.len();
            let marked = !segment.replacen(INLINE, "", 1).trim().is_empty();
            if lands_last || segment.matches(INLINE).count() != 1 || !marked {
                return InlineSystem::Fold;
            }
            if *index == 3 {
                let as_user = format!(r#"{{"role":"user","content":"{INLINE}"}}"#);
                let user = render(&inserted(messages, *index, &as_user), effort);
                if user.and_then(|user| insertion(base, &user).map(|(_, s)| s == segment)) == Some(true) {
                    return InlineSystem::Fold;
                }
            }
            if base.contains(REASONING) != new.contains(REASONING) {
                return InlineSystem::Fold;
            }
        }
        evaluated = Some(bases);
    }
    if evaluated.is_none() { InlineSystem::Fold } else { InlineSystem::Preserve }
}

/// Where `new` is `base` with one segment inserted, and the segment, if it is.
fn insertion<'n>(base: &str, new: &'n str) -> Option<(usize, &'n str)> {
    let (b, n) = (base.as_bytes(), new.as_bytes());
    let p = b.iter().zip(n).take_while(|(x, y)| x == y).count();
    let room = b.len().min(n.len()) - p;
    let s = b.iter().rev().zip(n.iter().rev()).take(room).take_while(|(x, y)| x == y).count();
    (p + s == b.len()).then(|| new.get(p..n.len() - s).map(|segment| (p, segment))).flatten()
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

mod text;

/// vLLM's `json.dumps(block.input or {})` (the input is an object: an absent or empty one is
/// `{}`), for Harmony; else the input as written.
fn tool_arguments(input: Option<&RawValue>, harmony: bool) -> Cow<'_, str> {
    let Some(input) = input else { return Cow::Borrowed("{}") };
    if !harmony {
        return Cow::Borrowed(input.get());
    }
    match serde_json::from_str::<serde_json::Value>(input.get()) {
        Ok(value) if value.as_object().is_some_and(|input| !input.is_empty()) => {
            Cow::Owned(crate::openai::chat_template::python_json_dumps(&value))
        }
        _ => Cow::Borrowed("{}"),
    }
}

#[cfg(test)]
mod tests;
