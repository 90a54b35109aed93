//! gpt-oss chats as vLLM 0.33 renders them: in OpenAI's Harmony format, built from the
//! messages directly (vLLM's `harmony_utils` with `oss-harmony` 0.0.11), not with the model's
//! chat template, which agrees with Harmony only up to the end of the system prompt.
//!
//! The prompt is a list of [`Piece`]s: texts, each encoded on its own without special
//! tokens (Harmony's `encode_ordinary`), and Harmony's special tokens by name. For a chat
//! completion:
//!
//! 1. The system message: the model identity, knowledge cutoff, `Current date:` (vLLM's
//!    `VLLM_SYSTEM_START_DATE` if set, else today; the replicas' clock, the router's here,
//!    in local time), `Reasoning:` the request's effort through the fleet's effort map (medium by
//!    default; only low, medium and high, as vLLM checks), and the required channels.
//! 2. A developer message: `# Instructions` with the text of a first system or developer
//!    message (its text parts joined), then the `# Tools`; there is none when that text is
//!    empty and there are no tools.
//! 3. The other messages: a user's content (each text part its own text); an assistant's
//!    reasoning (`reasoning`, or the older `reasoning_content`) on the analysis channel, its
//!    content on the final channel (or, beside tool calls, on the commentary channel), and
//!    each tool call as the assistant's on the commentary channel `to=functions.NAME`, of
//!    content type `<|constrain|>json` (as oss-harmony 0.0.11 writes vLLM's call), ended by
//!    `<|call|>`; a tool result as `functions.NAME` (named by its call's id) on
//!    the commentary channel `to=assistant`; a later system or developer message as another
//!    developer message. Reasoning before the last final answer is dropped.
//! 4. `<|start|>assistant`.
//!
//! A request's tools go into the developer message after the instructions, as a TypeScript
//! namespace ([`tools`]), and every system message then says where calls to them go.
//!
//! With vLLM's `VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS` ([`HarmonyChat::system_instructions`])
//! the first system or developer message's text goes into the system message instead, after
//! the model identity (the developer message then holds only tools), a later system message
//! is a system message of its own (medium effort) with its text there, and a later developer
//! message is an empty developer message (vLLM drops its text).

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

use super::error::RequestError;
use super::request::{Message, Part};

mod tools;
pub use tools::Tool;

/// A piece of a Harmony prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece<'a> {
    /// Text, encoded on its own without special tokens.
    Text(Cow<'a, str>),
    /// A special token, by its text (`<|start|>`, ...).
    Special(&'static str),
}

const START: &str = "<|start|>";
const MESSAGE: &str = "<|message|>";
const END: &str = "<|end|>";
const CHANNEL: &str = "<|channel|>";
const CALL: &str = "<|call|>";
const CONSTRAIN: &str = "<|constrain|>";

/// The system message's parts that do not change.
const IDENTITY: &str = "You are ChatGPT, a large language model trained by OpenAI.";
const CUTOFF: &str = "Knowledge cutoff: 2024-06";
const CHANNELS: &str =
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.";
const TOOL_CHANNEL: &str = "Calls to these tools must go to the commentary channel: 'functions'.";

/// The reasoning efforts Harmony takes.
const EFFORTS: [&str; 3] = ["high", "medium", "low"];

/// What a chat completion request brings to its Harmony prompt.
#[derive(Clone, Copy, Debug)]
pub struct HarmonyChat<'r, 'a> {
    pub messages: &'r [Message<'a>],
    /// The effort after the fleet's effort map; `None` is medium.
    pub reasoning_effort: Option<&'r str>,
    /// The request's tools (none after `tool_choice: "none"` with the fleet's exclusion
    /// flag).
    pub tools: &'r [Tool],
    /// `YYYY-MM-DD`.
    pub date: &'r str,
    /// vLLM's `VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS`: system instructions go into the
    /// system message (see the module docs).
    pub system_instructions: bool,
}

impl HarmonyChat<'_, '_> {
    /// A system message's text: `instructions` after the identity, `effort`.
    fn system(&self, instructions: Option<&str>, effort: &str) -> String {
        let instructions = instructions.map(|i| format!("\n{i}")).unwrap_or_default();
        let tools = if self.tools.is_empty() { String::new() } else { format!("\n{TOOL_CHANNEL}") };
        format!(
            "{IDENTITY}{instructions}\n{CUTOFF}\nCurrent date: {}\n\nReasoning: {effort}\n\n{CHANNELS}{tools}",
            self.date
        )
    }
}

/// The prompt of `chat` (see the module docs).
pub fn render<'r, 'a>(chat: &HarmonyChat<'r, 'a>) -> Result<Vec<Piece<'r>>, RequestError> {
    let effort = match chat.reasoning_effort {
        None => "medium",
        Some("none") => return Err(unsupported("Harmony does not support reasoning_effort='none'".into())),
        Some(effort) if EFFORTS.contains(&effort) => effort,
        Some(effort) => {
            return Err(unsupported(format!(
                "reasoning_effort={effort:?} is not supported by Harmony. Supported values are: high, medium, low."
            )));
        }
    };
    let mut messages = chat.messages;
    let mut first_instructions = None;
    if let Some((first, rest)) = messages.split_first()
        && matches!(&*first.role, "system" | "developer")
    {
        first_instructions = flattened(first);
        messages = rest;
    }
    let mut out = Vec::new();
    let in_system = first_instructions.as_deref().filter(|_| chat.system_instructions);
    message(&mut out, Header::of("system"), vec![Cow::Owned(chat.system(in_system, effort))], END);
    if chat.system_instructions {
        first_instructions = None;
    }
    // vLLM writes the developer message for instructions that are not empty, or for tools
    // (then with instructions that are).
    if first_instructions.as_ref().is_some_and(|t| !t.is_empty()) || !chat.tools.is_empty() {
        let mut sections: Vec<String> =
            first_instructions.iter().map(|text| instructions(text).into_owned()).collect();
        if !chat.tools.is_empty() {
            sections.push(tools::section(chat.tools));
        }
        message(&mut out, Header::of("developer"), vec![Cow::Owned(sections.join("\n\n"))], END);
    }
    let names = call_names(messages)?;
    let mut rendered: Vec<Rendered<'r>> = Vec::new();
    for m in messages {
        convert(m, chat, &names, &mut rendered)?;
    }
    // Reasoning that an answer on the final channel has followed is dropped.
    let last_final = rendered.iter().rposition(|r| r.channel == Some("final"));
    for (i, r) in rendered.into_iter().enumerate() {
        if !(last_final.is_some_and(|last| i < last) && r.channel == Some("analysis")) {
            out.extend(r.pieces);
        }
    }
    out.push(Piece::Special(START));
    out.push(Piece::Text(Cow::Borrowed("assistant")));
    Ok(out)
}

fn unsupported(message: String) -> RequestError {
    RequestError::Harmony(message)
}

/// A developer message's text for `text`.
fn instructions(text: &str) -> Cow<'static, str> {
    Cow::Owned(format!("# Instructions\n\n{text}"))
}

/// One Harmony message, with the channel it went to.
struct Rendered<'r> {
    channel: Option<&'static str>,
    pieces: Vec<Piece<'r>>,
}

/// A message's header: its author, channel, the recipient that follows the channel, and the
/// content type after it (written `<|constrain|>json`, as oss-harmony writes a call's).
#[derive(Clone, Copy)]
struct Header<'h> {
    author: &'h str,
    channel: Option<&'h str>,
    recipient: Option<&'h str>,
    content_type: Option<&'h str>,
}

impl<'h> Header<'h> {
    fn of(author: &'h str) -> Self {
        Header { author, channel: None, recipient: None, content_type: None }
    }

    fn on(self, channel: &'h str) -> Self {
        Header { channel: Some(channel), ..self }
    }
}

/// Appends one message: `<|start|>`, the header, `<|message|>`, the contents, then `end`.
fn message<'r>(out: &mut Vec<Piece<'r>>, header: Header<'_>, contents: Vec<Cow<'r, str>>, end: &'static str) {
    out.push(Piece::Special(START));
    out.push(Piece::Text(Cow::Owned(header.author.to_owned())));
    if let Some(channel) = header.channel {
        out.push(Piece::Special(CHANNEL));
        out.push(Piece::Text(Cow::Owned(channel.to_owned())));
    }
    if let Some(recipient) = header.recipient {
        out.push(Piece::Text(Cow::Owned(format!(" to={recipient}"))));
    }
    if let Some(content_type) = header.content_type {
        out.push(Piece::Text(Cow::Borrowed(" ")));
        out.push(Piece::Special(CONSTRAIN));
        out.push(Piece::Text(Cow::Owned(content_type.to_owned())));
    }
    out.push(Piece::Special(MESSAGE));
    out.extend(contents.into_iter().map(Piece::Text));
    out.push(Piece::Special(end));
}

/// The Harmony messages of one chat message (vLLM's `parse_chat_input_to_harmony_message`).
fn convert<'r>(
    m: &'r Message<'_>,
    chat: &HarmonyChat<'_, '_>,
    names: &[(String, String)],
    rendered: &mut Vec<Rendered<'r>>,
) -> Result<(), RequestError> {
    let mut push = |header: Header<'_>, contents: Vec<Cow<'r, str>>, end| {
        let mut pieces = Vec::new();
        message(&mut pieces, header, contents, end);
        let channel = match header.channel {
            Some("final") => Some("final"),
            Some("analysis") => Some("analysis"),
            Some(_) => Some("commentary"),
            None => None,
        };
        rendered.push(Rendered { channel, pieces });
    };
    // vLLM renames the older `reasoning_content` to `reasoning` when that is unset.
    let reasoning = match extra_str(m, "reasoning")? {
        Some(reasoning) => Some(reasoning),
        None => extra_str(m, "reasoning_content")?,
    };
    let reasoning = reasoning.filter(|r| !r.is_empty());
    let calls = tool_calls(m)?;
    let assistant = Header::of("assistant");
    match &*m.role {
        "assistant" if !calls.is_empty() => {
            if let Some(content) = flattened(m).filter(|c| !c.is_empty()) {
                push(assistant.on("commentary"), vec![content], END);
            }
            if let Some(reasoning) = reasoning {
                push(assistant.on("analysis"), vec![reasoning], END);
            }
            for call in calls {
                // vLLM's call: recipient `functions.<name>`, content type `json` (which
                // oss-harmony writes after `<|constrain|>`).
                let recipient = format!("functions.{}", call.name);
                let header = Header {
                    recipient: Some(&recipient),
                    content_type: Some("json"),
                    ..assistant.on("commentary")
                };
                push(header, vec![Cow::Owned(call.arguments)], CALL);
            }
        }
        "tool" => {
            let id = extra_str(m, "tool_call_id")?.unwrap_or_default();
            // The last call with the id names it, as in vLLM's map of ids to names.
            let name = names.iter().rev().find(|(i, _)| *i == id).map_or("", |(_, n)| n.as_str());
            let author = format!("functions.{name}");
            let header = Header { recipient: Some("assistant"), ..Header::of(&author).on("commentary") };
            push(header, vec![flattened(m).unwrap_or_default()], END);
        }
        "assistant" => {
            if let Some(reasoning) = reasoning {
                push(assistant.on("analysis"), vec![reasoning], END);
            }
            let contents = contents(m);
            if contents.first().is_some_and(|c| !c.is_empty()) {
                push(assistant.on("final"), contents, END);
            }
        }
        "system" | "developer" => match flattened(m) {
            Some(text) if chat.system_instructions && m.role == "system" => {
                push(Header::of("system"), vec![Cow::Owned(chat.system(Some(&text), "medium"))], END);
            }
            Some(_) if chat.system_instructions => {
                push(Header::of("developer"), vec![Cow::Borrowed("")], END)
            }
            Some(text) => push(Header::of("developer"), vec![instructions(&text)], END),
            None => {}
        },
        "user" => push(Header::of("user"), contents(m), END),
        other => return Err(unsupported(format!("'{other}' is not a role Harmony takes"))),
    }
    Ok(())
}

/// A message's content as one text (vLLM's `flatten_input_text_content`): the string, or
/// the text parts joined; `None` for no content or no text part.
fn flattened<'r>(m: &'r Message<'_>) -> Option<Cow<'r, str>> {
    match &m.parts {
        Some(parts) => {
            let texts: Vec<&str> = parts
                .iter()
                .filter_map(|p| match p {
                    Part::Text(t) => Some(&**t),
                    // vLLM's flattening reads `text` keys alone.
                    Part::Aside(_) | Part::ToolReference(_) => None,
                })
                .collect();
            (!texts.is_empty()).then(|| Cow::Owned(texts.concat()))
        }
        None => m.content.as_deref().map(Cow::Borrowed),
    }
}

/// A message's contents, each a text of its own: the string (empty when none), or every
/// part's text (a part without one is empty).
fn contents<'r>(m: &'r Message<'_>) -> Vec<Cow<'r, str>> {
    match &m.parts {
        Some(parts) => parts
            .iter()
            .map(|p| match p {
                Part::Text(t) => Cow::Borrowed(&**t),
                // vLLM's `TextContent(text=part.get("text", ""))`.
                Part::Aside(_) | Part::ToolReference(_) => Cow::Borrowed(""),
            })
            .collect(),
        None => vec![Cow::Borrowed(m.content.as_deref().unwrap_or_default())],
    }
}

/// A string key of the message besides `role` and `content`; null is none. (A key given
/// twice is its last value, as Python's `json` reads it.)
fn extra_str<'r>(m: &'r Message<'_>, key: &str) -> Result<Option<Cow<'r, str>>, RequestError> {
    let Some((_, raw)) = m.extra.iter().rev().find(|(k, _)| k == key) else { return Ok(None) };
    let value: Option<Cow<'r, str>> = serde_json::from_str(raw.get())
        .map_err(|_| unsupported(format!("'{key}' of a message must be a string")))?;
    Ok(value)
}

/// One tool call of an assistant message.
struct Call {
    id: String,
    name: String,
    arguments: String,
}

#[derive(Deserialize)]
struct RawCall<'a> {
    #[serde(default)]
    id: Option<String>,
    #[serde(default, borrow)]
    function: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct RawFunction<'a> {
    #[serde(default)]
    name: Option<String>,
    #[serde(default, borrow)]
    arguments: Option<&'a RawValue>,
}

/// The message's `tool_calls`, as vLLM reads them (a missing name or arguments is empty;
/// arguments that are not a string are their JSON text).
fn tool_calls(m: &Message<'_>) -> Result<Vec<Call>, RequestError> {
    let Some((_, raw)) = m.extra.iter().rev().find(|(k, _)| k == "tool_calls") else { return Ok(Vec::new()) };
    let bad = || unsupported("'tool_calls' must be a list of tool calls".into());
    let calls: Option<Vec<RawCall<'_>>> = serde_json::from_str(raw.get()).map_err(|_| bad())?;
    calls
        .unwrap_or_default()
        .into_iter()
        .map(|call| {
            let function: RawFunction<'_> = match call.function {
                Some(f) => serde_json::from_str(f.get()).map_err(|_| bad())?,
                None => RawFunction { name: None, arguments: None },
            };
            let arguments = match function.arguments {
                None => String::new(),
                Some(a) => match serde_json::from_str::<Option<String>>(a.get()) {
                    Ok(text) => text.unwrap_or_default(),
                    Err(_) => a.get().to_owned(),
                },
            };
            Ok(Call { id: call.id.unwrap_or_default(), name: function.name.unwrap_or_default(), arguments })
        })
        .collect()
}

/// Each tool call's id and function name, over the whole conversation.
fn call_names(messages: &[Message<'_>]) -> Result<Vec<(String, String)>, RequestError> {
    let mut names = Vec::new();
    for m in messages {
        names.extend(tool_calls(m)?.into_iter().map(|c| (c.id, c.name)));
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::ChatRequest;

    /// The pieces of `body`'s messages, written compactly: specials as they are, each text
    /// in brackets.
    fn rendered(body: &str, effort: Option<&str>) -> Result<String, RequestError> {
        let chat = ChatRequest::parse(body.as_bytes()).unwrap();
        let request = HarmonyChat {
            messages: &chat.messages,
            reasoning_effort: effort,
            tools: &[],
            date: "2026-11-27",
            system_instructions: false,
        };
        let pieces = render(&request)?;
        Ok(pieces
            .iter()
            .map(|p| match p {
                Piece::Text(t) => format!("[{t}]"),
                Piece::Special(s) => (*s).to_owned(),
            })
            .collect())
    }

    fn system(effort: &str) -> String {
        format!(
            "<|start|>[system]<|message|>[{IDENTITY}\n{CUTOFF}\nCurrent date: 2026-11-27\n\nReasoning: {effort}\n\n{CHANNELS}]<|end|>"
        )
    }

    #[test]
    fn a_first_system_message_is_the_developer_instructions() {
        let body = r#"{"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}]}"#;
        let expected = format!(
            "{}<|start|>[developer]<|message|>[# Instructions\n\nBe brief.]<|end|>\
             <|start|>[user]<|message|>[Hi]<|end|><|start|>[assistant]",
            system("medium")
        );
        assert_eq!(rendered(body, None).unwrap(), expected);
        let empty = r#"{"messages":[{"role":"developer","content":""},{"role":"user","content":"Hi"}]}"#;
        let expected = format!("{}<|start|>[user]<|message|>[Hi]<|end|><|start|>[assistant]", system("high"));
        assert_eq!(rendered(empty, Some("high")).unwrap(), expected, "an empty one is none");
    }

    #[test]
    fn history_keeps_answers_tool_calls_and_only_the_current_reasoning() {
        let body = r#"{"messages":[
            {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
            {"role":"assistant","content":"A1","reasoning":"old thought"},
            {"role":"user","content":"weather?"},
            {"role":"assistant","content":null,"reasoning_content":"call it","tool_calls":[
                {"id":"c1","type":"function","function":{"name":"get","arguments":"{\"q\":1}"}}]},
            {"role":"tool","tool_call_id":"c1","content":"sunny"},
            {"role":"system","content":"Later rule."}]}"#;
        let expected = format!(
            "{}<|start|>[user]<|message|>[a][b]<|end|>\
             <|start|>[assistant]<|channel|>[final]<|message|>[A1]<|end|>\
             <|start|>[user]<|message|>[weather?]<|end|>\
             <|start|>[assistant]<|channel|>[analysis]<|message|>[call it]<|end|>\
             <|start|>[assistant]<|channel|>[commentary][ to=functions.get][ ]<|constrain|>[json]<|message|>[{{\"q\":1}}]<|call|>\
             <|start|>[functions.get]<|channel|>[commentary][ to=assistant]<|message|>[sunny]<|end|>\
             <|start|>[developer]<|message|>[# Instructions\n\nLater rule.]<|end|>\
             <|start|>[assistant]",
            system("low")
        );
        assert_eq!(rendered(body, Some("low")).unwrap(), expected);
    }

    /// Regression: `refusal` and `thinking` parts were read as text. vLLM makes each part a
    /// `TextContent` of its `text` key (none: empty), so an assistant message of a refusal
    /// alone is left out, and a user's thinking part is an empty text.
    #[test]
    fn refusal_and_thinking_parts_have_no_text() {
        let body = r#"{"messages":[
            {"role":"user","content":"q"},
            {"role":"assistant","content":[{"type":"refusal","refusal":"I can't"}]},
            {"role":"user","content":[{"type":"thinking","thinking":"hm"},{"type":"text","text":"q2"}]},
            {"role":"developer","content":[{"type":"refusal","refusal":"no"},{"type":"text","text":"Be brief."}]}]}"#;
        let expected = format!(
            "{}<|start|>[user]<|message|>[q]<|end|>\
             <|start|>[user]<|message|>[][q2]<|end|>\
             <|start|>[developer]<|message|>[# Instructions\n\nBe brief.]<|end|><|start|>[assistant]",
            system("medium")
        );
        assert_eq!(rendered(body, None).unwrap(), expected);
    }

    /// A key given twice is its last value, as vLLM (Python's `json`) reads the message.
    #[test]
    fn a_repeated_key_is_its_last_value() {
        let body = r#"{"messages":[
            {"role":"user","content":"q"},
            {"role":"assistant","content":null,"reasoning":"first","reasoning":"second",
             "tool_calls":[{"id":"a","function":{"name":"one","arguments":"{}"}}],
             "tool_calls":[{"id":"b","function":{"name":"two","arguments":"{}"}}]}]}"#;
        let text = rendered(body, None).unwrap();
        assert!(text.contains("[second]") && !text.contains("[first]"), "{text}");
        assert!(text.contains("functions.two") && !text.contains("functions.one"), "{text}");
    }

    #[test]
    fn efforts_harmony_lacks_are_refused_as_vllm_refuses_them() {
        let body = r#"{"messages":[{"role":"user","content":"Hi"}]}"#;
        assert!(matches!(rendered(body, Some("none")), Err(RequestError::Harmony(_))));
        assert!(matches!(rendered(body, Some("xhigh")), Err(RequestError::Harmony(_))));
    }
}

/// Reference renderings: the conversation vLLM 0.33's own `harmony_utils` builds for each
/// request (its request parsing replayed), rendered by `oss-harmony` 0.0.11 (the package vLLM
/// renders gpt-oss prompts with) piece by piece, as in its source: the pieces, empty texts
/// left out, and the whole decoded to text (`tests/data/harmony-cases.json`). The cases with
/// `tools` validate them as vLLM's `ChatCompletionToolsParam` and take the system and
/// developer messages' texts from oss-harmony's own rendering of them. The `responses` cases
/// are rendered from their input items as vLLM's Responses path does (its
/// `responses/harmony.py`, after its request's own item parsing).
#[cfg(test)]
mod reference {
    use super::*;
    use crate::openai::ChatRequest;
    use crate::openai::request::responses::Responses;

    #[test]
    fn renderings_match_vllms_with_oss_harmony() {
        let cases: Vec<serde_json::Value> =
            serde_json::from_str(include_str!("../../tests/data/harmony-cases.json")).unwrap();
        assert!(cases.len() >= 30);
        assert!(cases.iter().filter(|c| c["request"].get("tools").is_some()).count() >= 10);
        assert!(cases.iter().filter(|c| c["api"] == "responses").count() >= 10);
        for case in cases {
            let mut body = case["request"].to_string();
            // A Responses request: the chat request made of it for Harmony.
            if case["api"] == "responses" {
                let request = Responses::read_as(body.as_bytes(), true).unwrap();
                body = String::from_utf8(request.chat_body(&[])).unwrap();
            }
            let request: serde_json::Value = serde_json::from_str(&body).unwrap();
            let chat = ChatRequest::parse(body.as_bytes()).unwrap();
            let tools = Tool::list(&request["tools"].to_string()).unwrap();
            let request = HarmonyChat {
                messages: &chat.messages,
                reasoning_effort: request["reasoning_effort"].as_str(),
                tools: &tools,
                date: case["date"].as_str().unwrap(),
                system_instructions: case["system_instructions"] == true,
            };
            let pieces = render(&request).unwrap();
            let segments: Vec<serde_json::Value> = pieces
                .iter()
                .filter(|p| !matches!(p, Piece::Text(t) if t.is_empty()))
                .map(|p| match p {
                    Piece::Text(t) => serde_json::json!({ "text": t }),
                    Piece::Special(s) => serde_json::json!({ "special": s }),
                })
                .collect();
            // Cases added later have the library's text alone.
            if let Some(expected) = case.get("segments") {
                assert_eq!(&serde_json::Value::from(segments), expected, "{}", case["name"]);
            }
            let text: String = pieces
                .iter()
                .map(|p| match p {
                    Piece::Text(t) => t.as_ref(),
                    Piece::Special(s) => s,
                })
                .collect();
            assert_eq!(text, case["rendered"].as_str().unwrap(), "{}", case["name"]);
        }
    }
}
