//! OpenAI's Responses API (`POST /v1/responses`) as vLLM serves it for a chat-template
//! model: a request becomes the chat completion request vLLM renders
//! (`vllm/entrypoints/openai/responses/utils.py`, `construct_input_messages`, and the
//! request's `build_chat_params`, vLLM 0.33), so the router and the replica agent compute the
//! prompt vLLM will.
//!
//! The conversion, in vLLM's order:
//!
//! 1. **Instructions.** A non-empty `instructions` string is the first message,
//!    `role: "system"` (for gpt-oss an empty one too: vLLM's Harmony path tells `""` from
//!    none).
//! 2. **History.** With `previous_response_id`, the stored conversation follows: the earlier
//!    request's messages less its system ones (instructions do not carry over), then each
//!    text of the earlier response's output as an assistant message. Only the replica that
//!    stored the response has it ([`Responses::chat_body`] takes it as `history`; the router
//!    sends such a request to that replica and computes no prompt).
//! 3. **Input.** A string is one user message. Of a list of items, in order:
//!    - `function_call` (and `custom_tool_call`, its `input` wrapped as `{"input": …}`)
//!      becomes a tool call `{"id": call_id, "function": {"name", "arguments"}, "type":
//!      "function"}`, added to the previous message when that is an assistant's, else a new
//!      assistant message;
//!    - `reasoning` becomes an assistant's `reasoning` (its first content text, else its
//!      first summary text), set on the previous assistant message when it has none;
//!    - an assistant `message` (or any item with `role: "assistant"`) becomes its first
//!      content text, set as the previous assistant message's content when it has none;
//!    - `function_call_output` and `custom_tool_call_output` become `role: "tool"` messages
//!      (`content` the output as it is, `tool_call_id` the call id);
//!    - any other item with a `role` goes to the template as it is (`input_text` parts read
//!      as text, `input_image` as media);
//!    - anything else is refused, as vLLM refuses it ("Unsupported input item type").
//!
//!    A `function_call` with a `namespace` is named `{namespace}__{name}`. A reasoning item
//!    with `encrypted_content` (which vLLM 0.33 refuses, and later versions may not) makes its
//!    message count as media, so the prompt is hashed up to that message.
//! 4. **Tools.** `function` tools become `{"type": "function", "function": {"name",
//!    "description", "parameters", "strict", "defer_loading"}}`; a `namespace` tool's functions the same, each
//!    named `{namespace}__{name}`; a `custom` tool a function taking one string `input`;
//!    every other tool type (web search, MCP, …) is not shown to the model and is dropped
//!    (a request whose tools are all such passes `[]`).
//! 5. **The rest.** `model`, `stream`, `cache_salt` and `chat_template_kwargs` carry over;
//!    `max_output_tokens` becomes `max_tokens`; `reasoning.effort` becomes
//!    `reasoning_effort`; the prompt is tokenized with the tokenizer's special tokens
//!    (`add_special_tokens`, vLLM's default for this API, unlike chat's). When the last item is an assistant message or a reasoning item
//!    whose `status` is `in_progress` or `incomplete`, the model continues it
//!    (`continue_final_message`, no generation prompt).
//!
//! For gpt-oss ([`Responses::read_as`] with `harmony`) vLLM makes Harmony messages of the
//! items itself (`vllm/entrypoints/openai/responses/harmony.py`), and the chat request made
//! here is the one whose Harmony rendering ([`crate::openai::harmony`]) is that: each
//! `function_call` an assistant message of its own, named without its namespace; each
//! `reasoning` item one of its own, its content's texts joined with `"\n"` (its summary
//! unread; an item without content is skipped); each assistant message one of its own,
//! every part's text kept; a tool output named by the latest call before it with its
//! `call_id` (calls may reuse one); the tools whatever `tool_choice` says. Not reproduced there: an
//! assistant answer with no text at all and a reasoning item whose only text is empty (vLLM
//! keeps both, empty; here they are dropped, and with the answer the analysis before it), a
//! later system item with no text (vLLM skips it), image parts (read as media here, as empty
//! texts by vLLM), and what vLLM refuses for Harmony (`custom_tool_call` items; `namespace`,
//! `custom` and MCP tools), which the replica answers with a 400.

use std::borrow::Cow;

use serde::Serialize;
use serde_json::value::RawValue;

use super::{Str, field, object, parse_object};
use crate::openai::error::RequestError;

/// The path of the Responses API.
pub const RESPONSES_PATH: &str = "/v1/responses";

/// What a `custom` tool's free-form input is wrapped in (vLLM's `CUSTOM_TOOL_INPUT_KEY`).
const CUSTOM_INPUT_KEY: &str = "input";

/// The function schema vLLM shows for a `custom` tool.
const CUSTOM_TOOL_PARAMETERS: &str = r#"{"type":"object","properties":{"input":{"type":"string","description":"The freeform text payload for this tool."}},"required":["input"],"additionalProperties":false}"#;

/// A Responses request, read as far as its prompt needs.
#[derive(Debug)]
pub struct Responses<'a> {
    /// The stored response this one continues, if any.
    pub previous_response_id: Option<Cow<'a, str>>,
    /// A JSON string, as written (a long system prompt is not escaped again).
    instructions: Option<&'a RawValue>,
    /// Read for gpt-oss: an empty `instructions` string is kept (see [`Responses::chat_body`]).
    harmony: bool,
    input: Vec<Msg<'a>>,
    continue_final: bool,
    rest: Rest<'a>,
    /// The request body's length: about the converted body's.
    body_len: usize,
}

/// The fields carried over to the chat request as they are.
#[derive(Debug, Serialize)]
struct Rest<'a> {
    model: Cow<'a, str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_salt: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    priority: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    chat_template_kwargs: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_effort: Option<&'a RawValue>,
    /// `None` when the request has no tools; `[]` when none of them is shown to the model,
    /// as vLLM passes it.
    #[serde(skip_serializing_if = "Option::is_none")]
    tools: Option<Vec<Tool<'a>>>,
    /// `"none"` when the request's is (what `--exclude-tools-when-tool-choice-none` reads).
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<&'static str>,
    /// vLLM tokenizes a Responses prompt with the tokenizer's special tokens (a BOS), where
    /// a chat request's default is without.
    add_special_tokens: bool,
    /// `-1` for `truncation: "auto"`, as vLLM reads it: the prompt's last tokens that fit
    /// the context with the output.
    #[serde(skip_serializing_if = "Option::is_none")]
    truncate_prompt_tokens: Option<i8>,
}

/// One chat message made of the input.
#[derive(Debug)]
enum Msg<'a> {
    /// An item with a role, as it is.
    Raw(&'a RawValue),
    /// The input string, as a user message.
    User(&'a RawValue),
    /// An assistant's turn built of items.
    Assistant(Assistant<'a>),
    /// A tool's output.
    Tool { content: Option<&'a RawValue>, tool_call_id: Option<CallId<'a>> },
}

/// A tool output's call id: as written, or the id given to a call whose id an earlier call
/// had (Harmony, see [`CallIds`]).
#[derive(Debug, Serialize)]
#[serde(untagged)]
enum CallId<'a> {
    Raw(&'a RawValue),
    Renamed(String),
}

/// For Harmony: vLLM names a tool output by the latest call before it with its `call_id`,
/// where a chat names it by the last call with the id in the whole conversation. A call whose
/// id an earlier call had gets an id of its own (ids are not rendered, only names), and
/// outputs after it take that id.
#[derive(Default)]
struct CallIds<'a> {
    /// Each id used, and how many calls used it after the first.
    seen: Vec<(Cow<'a, str>, usize)>,
}

impl<'a> CallIds<'a> {
    fn renamed(id: &str, again: usize) -> String {
        format!("{id}\u{1f}{again}")
    }

    /// The id a call with `id` goes by.
    fn call(&mut self, id: Cow<'a, str>) -> Cow<'a, str> {
        match self.seen.iter_mut().find(|(seen, _)| *seen == id) {
            Some((_, again)) => {
                *again += 1;
                Cow::Owned(Self::renamed(&id, *again))
            }
            None => {
                self.seen.push((id.clone(), 0));
                id
            }
        }
    }

    /// The id an output naming `raw` (a JSON string) refers to.
    fn output(&self, raw: &'a RawValue) -> CallId<'a> {
        let id = serde_json::from_str::<Cow<'_, str>>(raw.get()).ok();
        match id.and_then(|id| self.seen.iter().find(|(seen, _)| *seen == id)) {
            Some((id, again)) if *again > 0 => CallId::Renamed(Self::renamed(id, *again)),
            _ => CallId::Raw(raw),
        }
    }
}

#[derive(Debug, Default, Serialize)]
struct Assistant<'a> {
    role: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<Vec<ToolCall<'a>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning: Option<Cow<'a, str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<Content<'a>>,
}

#[derive(Debug, Serialize)]
#[serde(untagged)]
enum Content<'a> {
    Text(Cow<'a, str>),
    /// A part the chat parser takes for media: what vLLM reads here is not reproduced, so the
    /// prompt is hashed up to this message.
    Opaque([Opaque; 1]),
    /// Text parts, each its own (for Harmony).
    Parts(Vec<TextPart<'a>>),
}

#[derive(Debug, Serialize)]
struct TextPart<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    text: Cow<'a, str>,
}

#[derive(Debug, Serialize)]
struct Opaque {
    #[serde(rename = "type")]
    kind: &'static str,
}

const OPAQUE: Opaque = Opaque { kind: "unreproduced" };

#[derive(Debug, Serialize)]
struct ToolCall<'a> {
    id: Cow<'a, str>,
    function: Function<'a>,
    #[serde(rename = "type")]
    kind: &'static str,
}

#[derive(Debug, Serialize)]
struct Function<'a> {
    name: Cow<'a, str>,
    arguments: Cow<'a, str>,
}

#[derive(Debug, Serialize)]
struct Tool<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    function: ToolFunction<'a>,
}

#[derive(Debug, Serialize)]
struct ToolFunction<'a> {
    name: Cow<'a, str>,
    description: Option<&'a RawValue>,
    parameters: Option<Cow<'a, RawValue>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    strict: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    defer_loading: Option<&'a RawValue>,
}

impl<'a> Responses<'a> {
    /// Reads a Responses request body, for a model whose chat template renders its prompt.
    pub fn read(body: &'a [u8]) -> Result<Self, RequestError> {
        Self::read_as(body, false)
    }

    /// Reads a Responses request body; with `harmony`, for gpt-oss, whose input items vLLM
    /// turns into Harmony messages of their own (see the module docs).
    pub fn read_as(body: &'a [u8], harmony: bool) -> Result<Self, RequestError> {
        let [
            model,
            input,
            instructions,
            previous,
            stream,
            max_output_tokens,
            cache_salt,
            kwargs,
            reasoning,
            tools,
            tool_choice,
            priority,
            truncation,
        ] = parse_object(
            body,
            &[
                "model",
                "input",
                "instructions",
                "previous_response_id",
                "stream",
                "max_output_tokens",
                "cache_salt",
                "chat_template_kwargs",
                "reasoning",
                "tools",
                "tool_choice",
                "priority",
                "truncation",
            ],
        )?;
        // vLLM's `-1 if truncation != "disabled"`. (An explicit null, which vLLM reads as -1
        // too, is read here as absent, as every null field is.)
        let truncate_prompt_tokens = match truncation.map(RawValue::get) {
            None | Some(r#""disabled""#) => None,
            Some(r#""auto""#) => Some(-1),
            Some(_) => return Err(invalid("truncation", r#""auto" or "disabled""#)),
        };
        let model = field::<Str>(model, "model", "a string")?.map(|s| s.0).unwrap_or_default();
        if instructions.is_some_and(|raw| !raw.get().starts_with('"')) {
            return Err(invalid("instructions", "a string"));
        }
        let previous_response_id = field::<Str>(previous, "previous_response_id", "a string")?.map(|s| s.0);
        let input = input.ok_or(RequestError::MissingField { param: "input" })?;
        let (input, continue_final) = read_input(input, harmony)?;
        let reasoning_effort = match reasoning {
            Some(raw) => {
                let [effort] = object::fields(raw.get().as_bytes(), &["effort"])
                    .map_err(|_| invalid("reasoning", "an object"))?;
                effort
            }
            None => None,
        };
        // vLLM passes `[]` for tools none of which is shown to the model.
        let tools = match tools {
            Some(raw) if raw.get().starts_with('[') && !raw.get()[1..].trim_start().starts_with(']') => {
                Some(read_tools(raw)?)
            }
            Some(raw) => Some(read_tools(raw)?).filter(|t| !t.is_empty()),
            None => None,
        };
        let rest = Rest {
            model,
            stream,
            max_tokens: max_output_tokens,
            cache_salt,
            priority,
            chat_template_kwargs: kwargs,
            reasoning_effort,
            tools,
            // vLLM's Harmony path keeps the tools whatever the tool choice.
            tool_choice: tool_choice.filter(|c| !harmony && c.get() == r#""none""#).map(|_| "none"),
            add_special_tokens: true,
            truncate_prompt_tokens,
        };
        Ok(Responses {
            previous_response_id,
            instructions,
            harmony,
            input,
            continue_final,
            rest,
            body_len: body.len(),
        })
    }

    /// `max_output_tokens`, if set.
    pub fn max_output_tokens(&self) -> Result<Option<u64>, RequestError> {
        super::count(self.rest.max_tokens, "max_output_tokens")
    }

    /// `priority` (vLLM's: lower is served first; 0 unless set).
    pub fn priority(&self) -> Result<i64, RequestError> {
        super::priority(self.rest.priority)
    }

    /// The chat completion request vLLM renders, as JSON: the instructions, then `history`
    /// (the stored conversation a `previous_response_id` names, already without its system
    /// messages), then the input.
    pub fn chat_body(&self, history: &[&RawValue]) -> Vec<u8> {
        #[derive(Serialize)]
        struct Chat<'r, 'a> {
            messages: Vec<MsgOut<'r, 'a>>,
            #[serde(skip_serializing_if = "std::ops::Not::not")]
            continue_final_message: bool,
            /// `false` when the model continues the last message (a chat request's default is
            /// `true`).
            #[serde(skip_serializing_if = "Option::is_none")]
            add_generation_prompt: Option<bool>,
            #[serde(flatten)]
            rest: &'r Rest<'a>,
        }
        let mut messages = Vec::with_capacity(1 + history.len() + self.input.len());
        // An empty string is no system message, except for Harmony: vLLM's Harmony path then
        // writes an empty `# Instructions` beside the tools, and leaves a first system item
        // where it is (a developer message of its own) instead of taking it as instructions.
        if let Some(instructions) = self.instructions.filter(|i| self.harmony || i.get() != r#""""#) {
            messages.push(MsgOut::System(System { role: "system", content: instructions }));
        }
        messages.extend(history.iter().map(|raw| MsgOut::Msg(Msg::Raw(raw))));
        messages.extend(self.input.iter().map(MsgOut::Input));
        let chat = Chat {
            messages,
            continue_final_message: self.continue_final,
            add_generation_prompt: self.continue_final.then_some(false),
            rest: &self.rest,
        };
        // Strings, raw JSON and options only: serializing cannot fail.
        let mut out = Vec::with_capacity(self.body_len + 256);
        let _ = serde_json::to_writer(&mut out, &chat);
        out
    }
}

#[derive(Serialize)]
struct System<'a> {
    role: &'static str,
    content: &'a RawValue,
}

#[derive(Serialize)]
#[serde(untagged)]
enum MsgOut<'r, 'a> {
    System(System<'r>),
    Msg(Msg<'r>),
    Input(&'r Msg<'a>),
}

impl Serialize for Msg<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct ToolMsg<'a> {
            role: &'static str,
            content: Option<&'a RawValue>,
            tool_call_id: &'a Option<CallId<'a>>,
        }
        #[derive(Serialize)]
        struct User<'a> {
            role: &'static str,
            content: &'a RawValue,
        }
        match self {
            Msg::Raw(raw) => raw.serialize(s),
            Msg::User(content) => User { role: "user", content }.serialize(s),
            Msg::Assistant(a) => a.serialize(s),
            Msg::Tool { content, tool_call_id } => {
                ToolMsg { role: "tool", content: *content, tool_call_id }.serialize(s)
            }
        }
    }
}

/// Whether a Responses request asks for its response to be kept (`store`): absent is true
/// (vLLM's default), `null` false (Python's `if request.store`). Whether it is kept is the
/// server's choice too (vLLM's `VLLM_ENABLE_RESPONSES_API_STORE`).
pub fn asks_to_store(body: &[u8]) -> Result<bool, RequestError> {
    #[derive(serde::Deserialize)]
    struct Flags {
        #[serde(default = "absent")]
        store: Option<bool>,
    }
    fn absent() -> Option<bool> {
        Some(true)
    }
    serde_json::from_slice::<Flags>(body)
        .map(|flags| flags.store.unwrap_or(false))
        .map_err(|_| invalid("store", "a boolean"))
}

/// Whether a Responses request asks to run in the background (`background`, read as vLLM
/// reads it: its last value, a lax boolean; absent and `null` are false). vLLM answers one at
/// once and generates its response after (`GET /v1/responses/{id}` shows it `queued`, then
/// final).
pub fn runs_in_background(body: &[u8]) -> Result<bool, RequestError> {
    let [background] = super::parse_object(body, &["background"])?;
    background.map_or(Ok(false), |raw| super::lax_boolean(raw).ok_or(invalid("background", "a boolean")))
}

fn invalid(param: &'static str, expected: &'static str) -> RequestError {
    RequestError::InvalidField { param, expected }
}

fn invalid_at(at: String, expected: &'static str) -> RequestError {
    RequestError::InvalidAt { at, expected }
}

fn str_at<'a>(
    raw: Option<&'a RawValue>,
    at: impl FnOnce() -> String,
) -> Result<Option<Cow<'a, str>>, RequestError> {
    raw.map(|raw| {
        serde_json::from_str::<Str<'a>>(raw.get()).map(|s| s.0).map_err(|_| invalid_at(at(), "a string"))
    })
    .transpose()
}

/// The input's messages, and whether the model continues the last one.
fn read_input(raw: &RawValue, harmony: bool) -> Result<(Vec<Msg<'_>>, bool), RequestError> {
    if raw.get().starts_with('"') {
        serde_json::from_str::<Str<'_>>(raw.get()).map_err(|_| invalid("input", "a string"))?;
        return Ok((vec![Msg::User(raw)], false));
    }
    let items: Vec<&RawValue> =
        serde_json::from_str(raw.get()).map_err(|_| invalid("input", "a string or an array of items"))?;
    let mut messages: Vec<Msg<'_>> = Vec::with_capacity(items.len());
    let mut continue_final = false;
    let mut call_ids = CallIds::default();
    for (i, item) in items.iter().enumerate() {
        let at = |field: &str| format!("input[{i}].{field}");
        let [
            kind,
            role,
            content,
            call_id,
            name,
            arguments,
            input,
            output,
            summary,
            encrypted,
            namespace,
            status,
        ] = object::fields(
            item.get().as_bytes(),
            &[
                "type",
                "role",
                "content",
                "call_id",
                "name",
                "arguments",
                "input",
                "output",
                "summary",
                "encrypted_content",
                "namespace",
                "status",
            ],
        )
        .map_err(|_| invalid_at(format!("input[{i}]"), "an object"))?;
        let kind = str_at(kind, || at("type"))?;
        let role = str_at(role, || at("role"))?;
        let status = str_at(status, || at("status"))?;
        continue_final = i + 1 == items.len()
            && matches!(kind.as_deref().unwrap_or("message"), "message" | "reasoning")
            && matches!(status.as_deref(), Some("in_progress" | "incomplete"));
        let prev = match messages.last_mut() {
            Some(Msg::Assistant(a)) => Some(a),
            _ => None,
        };
        match (kind.as_deref(), role.as_deref()) {
            (Some("function_call"), _) => {
                // A namespaced call is named as vLLM flattens it.
                let name = str_at(name, || at("name"))?.ok_or_else(|| invalid_at(at("name"), "a string"))?;
                let name = match str_at(namespace, || at("namespace"))? {
                    Some(namespace) if !namespace.is_empty() && !harmony => {
                        Cow::Owned(format!("{namespace}__{name}"))
                    }
                    _ => name,
                };
                let call = ToolCall {
                    id: str_at(call_id, || at("call_id"))?
                        .ok_or_else(|| invalid_at(at("call_id"), "a string"))?,
                    function: Function {
                        name,
                        arguments: str_at(arguments, || at("arguments"))?
                            .ok_or_else(|| invalid_at(at("arguments"), "a string"))?,
                    },
                    kind: "function",
                };
                if harmony {
                    let call = ToolCall { id: call_ids.call(call.id), ..call };
                    messages.push(Msg::Assistant(Assistant {
                        role: "assistant",
                        tool_calls: Some(vec![call]),
                        ..Assistant::default()
                    }));
                } else {
                    add_tool_call(&mut messages, call);
                }
            }
            (Some("custom_tool_call"), _) => {
                let payload = str_at(input, || at("input"))?.unwrap_or_default();
                let arguments = python_json_object(CUSTOM_INPUT_KEY, &payload);
                let call = ToolCall {
                    id: str_at(call_id, || at("call_id"))?
                        .ok_or_else(|| invalid_at(at("call_id"), "a string"))?,
                    function: Function {
                        name: str_at(name, || at("name"))?
                            .ok_or_else(|| invalid_at(at("name"), "a string"))?,
                        arguments: Cow::Owned(arguments),
                    },
                    kind: "function",
                };
                add_tool_call(&mut messages, call);
            }
            // Harmony: the content's texts on lines of their own (an item without any is
            // skipped), its summary and encrypted content unread.
            (Some("reasoning"), _) if harmony => {
                let texts = part_texts(content, || at("content"))?;
                if !texts.is_empty() {
                    messages.push(Msg::Assistant(Assistant {
                        role: "assistant",
                        reasoning: Some(Cow::Owned(texts.join("\n"))),
                        ..Assistant::default()
                    }));
                }
            }
            (Some("reasoning"), _) => {
                // An empty `encrypted_content` is none to vLLM (Python's falsy string).
                let encrypted = encrypted.filter(|e| !matches!(e.get(), "\"\"" | "null"));
                let text = if encrypted.is_some() {
                    None
                } else {
                    Some(
                        first_text(content, || at("content"))?
                            .or(first_text(summary, || at("summary"))?)
                            .unwrap_or_default(),
                    )
                };
                match prev {
                    Some(a) if a.reasoning.is_none() && !matches!(a.content, Some(Content::Opaque(_))) => {
                        match text {
                            Some(text) => a.reasoning = Some(text),
                            None => a.content = Some(Content::Opaque([OPAQUE])),
                        }
                    }
                    _ => messages.push(Msg::Assistant(Assistant {
                        role: "assistant",
                        reasoning: text.clone(),
                        content: text.is_none().then_some(Content::Opaque([OPAQUE])),
                        ..Assistant::default()
                    })),
                }
            }
            (Some("function_call_output" | "custom_tool_call_output"), _) => {
                let tool_call_id = match harmony {
                    true => call_id.map(|raw| call_ids.output(raw)),
                    false => call_id.map(CallId::Raw),
                };
                messages.push(Msg::Tool { content: output, tool_call_id });
            }
            // Harmony: every part's text (a part without one, empty), an answer of its own.
            // Empty texts add no tokens: leaving them out keeps an answer whose first part is
            // empty (a refusal, say) on the final channel, where vLLM puts it.
            (_, Some("assistant")) if harmony => {
                let content = match content {
                    Some(raw) if raw.get().starts_with('"') => {
                        Content::Text(str_at(Some(raw), || at("content"))?.unwrap_or_default())
                    }
                    content => {
                        let mut texts = part_texts(content, || at("content"))?;
                        if texts.iter().any(|t| !t.is_empty()) {
                            texts.retain(|t| !t.is_empty());
                        }
                        Content::Parts(
                            texts.into_iter().map(|text| TextPart { kind: "text", text }).collect(),
                        )
                    }
                };
                messages.push(Msg::Assistant(Assistant {
                    role: "assistant",
                    content: Some(content),
                    ..Assistant::default()
                }));
            }
            (_, Some("assistant")) if let Some(text) = assistant_text(content, || at("content"))? => {
                match prev {
                    Some(a) if a.content.is_none() => a.content = Some(Content::Text(text)),
                    _ => messages.push(Msg::Assistant(Assistant {
                        role: "assistant",
                        content: Some(Content::Text(text)),
                        ..Assistant::default()
                    })),
                }
            }
            (_, Some(_)) => messages.push(Msg::Raw(item)),
            (kind, None) => {
                return Err(invalid_at(
                    format!("input[{i}].type"),
                    match kind {
                        Some(_) => {
                            "a supported input item type (message, function_call, function_call_output, reasoning, custom_tool_call, custom_tool_call_output)"
                        }
                        None => "an item with a type or a role",
                    },
                ));
            }
        }
    }
    Ok((messages, continue_final))
}

/// A tool call joins the previous assistant message, or starts one.
fn add_tool_call<'a>(messages: &mut Vec<Msg<'a>>, call: ToolCall<'a>) {
    let assistant = match messages.last_mut() {
        Some(Msg::Assistant(a)) => a,
        _ => {
            messages.push(Msg::Assistant(Assistant { role: "assistant", ..Assistant::default() }));
            let Some(Msg::Assistant(a)) = messages.last_mut() else { unreachable!("just pushed") };
            a
        }
    };
    assistant.tool_calls.get_or_insert_with(Vec::new).push(call);
}

/// The text of an assistant item's `content`: a string, or its first part's `text`.
fn assistant_text<'a>(
    content: Option<&'a RawValue>,
    at: impl Fn() -> String,
) -> Result<Option<Cow<'a, str>>, RequestError> {
    let Some(content) = content else { return Ok(None) };
    if content.get().starts_with('"') {
        return str_at(Some(content), at);
    }
    first_text(Some(content), at)
}

/// The `text` of the first item of a list (`None` for an empty or absent list).
fn first_text<'a>(
    list: Option<&'a RawValue>,
    at: impl Fn() -> String,
) -> Result<Option<Cow<'a, str>>, RequestError> {
    let Some(list) = list else { return Ok(None) };
    let items: Vec<&RawValue> = serde_json::from_str(list.get()).map_err(|_| invalid_at(at(), "an array"))?;
    let Some(first) = items.first() else { return Ok(None) };
    let [text] = object::fields(first.get().as_bytes(), &["text"])
        .map_err(|_| invalid_at(at(), "an array of objects"))?;
    str_at(text, || format!("{}[0].text", at()))
}

/// The `text` of every item of a list, empty for an item without one (none for an absent
/// list).
fn part_texts<'a>(
    list: Option<&'a RawValue>,
    at: impl Fn() -> String,
) -> Result<Vec<Cow<'a, str>>, RequestError> {
    let Some(list) = list.filter(|l| l.get() != "null") else { return Ok(Vec::new()) };
    let items: Vec<&RawValue> = serde_json::from_str(list.get()).map_err(|_| invalid_at(at(), "an array"))?;
    let mut texts = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let [text] = object::fields(item.get().as_bytes(), &["text"])
            .map_err(|_| invalid_at(at(), "an array of objects"))?;
        texts.push(str_at(text, || format!("{}[{i}].text", at()))?.unwrap_or_default());
    }
    Ok(texts)
}

/// `json.dumps({key: value}, ensure_ascii=False)`: Python's separators, its escapes.
fn python_json_object(key: &str, value: &str) -> String {
    // serde_json escapes as json.dumps with ensure_ascii=False does, but for U+007F-U+009F
    // and U+2028/U+2029 which both leave as they are.
    format!(
        "{{{}: {}}}",
        serde_json::to_string(key).unwrap_or_default(),
        serde_json::to_string(value).unwrap_or_default()
    )
}

fn read_tools(raw: &RawValue) -> Result<Vec<Tool<'_>>, RequestError> {
    let items: Vec<&RawValue> =
        serde_json::from_str(raw.get()).map_err(|_| invalid("tools", "an array of tools"))?;
    let mut tools = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let at = |field: &str| format!("tools[{i}].{field}");
        let [kind, name, description, parameters, strict, nested, defer] = object::fields(
            item.get().as_bytes(),
            &["type", "name", "description", "parameters", "strict", "tools", "defer_loading"],
        )
        .map_err(|_| invalid_at(format!("tools[{i}]"), "an object"))?;
        let kind = str_at(kind, || at("type"))?.ok_or_else(|| invalid_at(at("type"), "a string"))?;
        let name = || str_at(name, || at("name"))?.ok_or_else(|| invalid_at(at("name"), "a string"));
        match &*kind {
            "function" => tools.push(function_tool(
                name()?,
                description,
                parameters.map(Cow::Borrowed),
                (strict, defer),
            )),
            "custom" => {
                let parameters =
                    RawValue::from_string(CUSTOM_TOOL_PARAMETERS.to_owned()).ok().map(Cow::Owned);
                tools.push(function_tool(name()?, description, parameters, (None, defer)));
            }
            "namespace" => {
                let namespace = name()?;
                let nested: Vec<&RawValue> = match nested {
                    Some(raw) => {
                        serde_json::from_str(raw.get()).map_err(|_| invalid_at(at("tools"), "an array"))?
                    }
                    None => Vec::new(),
                };
                for (j, tool) in nested.iter().enumerate() {
                    let at = |field: &str| format!("tools[{i}].tools[{j}].{field}");
                    let [kind, name, description, parameters, strict, defer] = object::fields(
                        tool.get().as_bytes(),
                        &["type", "name", "description", "parameters", "strict", "defer_loading"],
                    )
                    .map_err(|_| invalid_at(format!("tools[{i}].tools[{j}]"), "an object"))?;
                    if str_at(kind, || at("type"))?.as_deref() != Some("function") {
                        continue;
                    }
                    let name =
                        str_at(name, || at("name"))?.ok_or_else(|| invalid_at(at("name"), "a string"))?;
                    let flat = Cow::Owned(format!("{namespace}__{name}"));
                    tools.push(function_tool(
                        flat,
                        description,
                        parameters.map(Cow::Borrowed),
                        (strict, defer),
                    ));
                }
            }
            _ => {}
        }
    }
    Ok(tools)
}

fn function_tool<'a>(
    name: Cow<'a, str>,
    description: Option<&'a RawValue>,
    parameters: Option<Cow<'a, RawValue>>,
    (strict, defer_loading): (Option<&'a RawValue>, Option<&'a RawValue>),
) -> Tool<'a> {
    Tool { kind: "function", function: ToolFunction { name, description, parameters, strict, defer_loading } }
}

#[cfg(test)]
mod tests;
