//! A chat as SGLang renders it with the model's template ([`ChatTemplate::render_as_sglang`]),
//! where it differs from vLLM (`serving_chat.py`'s `_apply_jinja_template` and
//! `jinja_template_utils.py`, SGLang of 2026):
//!
//! - a list content, for a template that takes a string, is its text parts joined with a
//!   space (empty ones too; vLLM joins the non-empty ones with a newline), and a tool turn's
//!   list of text parts is one string so joined in the "openai" format too;
//! - a message without content has the empty string;
//! - a last assistant message with a string content is a user message (its role and content
//!   only), or with `continue_final_message`, it is left out and its text follows the prompt
//!   as it is (the template's end of a turn not cut off);
//! - every chat has the generation prompt (SGLang's chat requests have no
//!   `add_generation_prompt`), and no `documents`;
//! - the tools are left out for `tool_choice: "none"`, with or without vLLM's flag, and when
//!   they are an empty list, and are dumped as SGLang's models dump them ([`tools_value`]).
//!
//! A conversation's beginning ([`Variables::beginning`]) has neither the generation prompt nor
//! its last turn changed.
//! - a `reasoning_effort` sets both `thinking` and `enable_thinking` (to whether it is not
//!   "none") unless the kwargs do, and reaches the template as it is (no effort map); one in
//!   the kwargs wins over it.
//!
//! Not followed: which part types count as text (SGLang reads `text` and `input_text` only,
//! a plain string part not at all), a named `tool_choice` (SGLang passes that tool alone),
//! SGLang's reading of a template's content format (any template that mentions "image",
//! "audio", "video" or "vision" takes parts), the message keys it keeps (a user turn's `name`
//! dropped, an assistant's `reasoning` not read as `reasoning_content`), and its own
//! conversation templates (`--chat-template` naming one).

use std::borrow::Cow;
use std::collections::BTreeMap;

use minijinja::Value;
use serde::Serialize;
use serde_json::value::RawValue;

use super::{ChatTemplate, ContentFormat, Facts, Flag, Variables, dump_tools, message_value, texts_joined};
use crate::openai::error::RequestError;
use crate::openai::request::{Message, Part};

impl ChatTemplate {
    /// [`ChatTemplate::render_chosen`] as SGLang renders (module docs).
    pub(super) fn render_sglang(
        &self,
        facts: &Facts,
        format: ContentFormat,
        messages: &[Message<'_>],
        vars: Variables<'_>,
        media_parts: bool,
    ) -> Result<String, RequestError> {
        let mut passed: Vec<Message<'_>> = messages.iter().map(|m| passed(m, format)).collect();
        let mut continued = None;
        if let Some(last) = passed.last_mut()
            && last.role == "assistant"
            && last.parts.is_none()
            && !vars.beginning
        {
            let content = last.content.take().unwrap_or_default();
            match vars.continue_final_message {
                true => {
                    continued = Some(content);
                    passed.pop();
                }
                false => {
                    *last = Message {
                        role: "user".into(),
                        content: Some(content),
                        media: last.media.take(),
                        extra: Vec::new(),
                        parts: None,
                    }
                }
            }
        }
        let messages =
            passed.iter().map(|m| message_value(m, media_parts, format)).collect::<Result<Vec<_>, _>>()?;
        let rendered = self.render_context(facts, self.sglang_kwargs(&vars)?, messages)?;
        Ok(match continued {
            Some(text) => rendered + &text,
            None => rendered,
        })
    }

    /// The template variables SGLang sets (module docs): the fleet's default kwargs, the
    /// tools, the reasoning effort, then the request's kwargs over them, and the generation
    /// prompt (not after a conversation's beginning, [`Variables::beginning`]).
    fn sglang_kwargs(&self, vars: &Variables<'_>) -> Result<BTreeMap<String, Value>, RequestError> {
        let mut request = self.request_kwargs(vars)?;
        if let Some(effort) = vars.reasoning_effort {
            for key in ["thinking", "enable_thinking"] {
                request.entry(key.into()).or_insert_with(|| Value::from(effort != "none"));
            }
        }
        let mut merged = self.default_kwargs()?;
        if let Some(tools) = vars.tools {
            merged.insert("tools".into(), tools_value(tools)?);
        }
        if let Some(effort) = vars.reasoning_effort {
            merged.insert("reasoning_effort".into(), Value::from(effort));
        }
        merged.extend(request);
        merged.insert("add_generation_prompt".into(), Value::from(!vars.beginning));
        for argument in ["continue_final_message", "chat_template", "tokenize"] {
            merged.remove(argument);
        }
        Ok(merged)
    }
}

/// The request's `tools` as SGLang hands them to the template (each its pydantic model
/// dumped): a tool whose `function` is an object becomes `{"type", "function":
/// {"description", "name", "parameters", "strict"}, "defer_loading"}` in that order, the
/// type the tool's own (`"function"` when absent), `description`, `parameters` and the tool's
/// `defer_loading` null when absent, `strict` false when absent, and the function's
/// `defer_loading` (its own, else the tool's) after `strict` when set; anything else is passed
/// as it is.
fn tools_value(raw: &RawValue) -> Result<Value, RequestError> {
    #[derive(Serialize)]
    struct Function<'a> {
        description: Option<&'a RawValue>,
        name: Option<&'a RawValue>,
        parameters: Option<&'a RawValue>,
        strict: Flag<'a>,
        #[serde(skip_serializing_if = "Option::is_none")]
        defer_loading: Option<Flag<'a>>,
    }
    #[derive(Serialize)]
    #[serde(untagged)]
    enum Kind<'a> {
        Given(&'a RawValue),
        Function(&'static str),
    }
    #[derive(Serialize)]
    struct Dumped<'a> {
        #[serde(rename = "type")]
        kind: Kind<'a>,
        function: Function<'a>,
        defer_loading: Option<Flag<'a>>,
    }
    dump_tools(raw, |tool, function| Dumped {
        kind: tool.kind.map_or(Kind::Function("function"), Kind::Given),
        function: Function {
            description: function.description,
            name: function.name,
            parameters: function.parameters,
            strict: function.strict.unwrap_or(Flag::Bool(false)),
            defer_loading: function.defer_loading.or(tool.defer_loading),
        },
        defer_loading: tool.defer_loading,
    })
}

/// `message` as SGLang passes it to a template taking `format` (module docs).
fn passed<'a>(message: &Message<'a>, format: ContentFormat) -> Message<'a> {
    let mut message = message.clone();
    let joined = |parts: &[Part<'a>]| Cow::Owned(texts_joined(parts, " "));
    match (format, message.parts.take()) {
        (ContentFormat::String, Some(parts)) => message.content = Some(joined(&parts)),
        (ContentFormat::OpenAi, Some(parts))
            if message.role == "tool"
                && message.media.is_none()
                && parts.iter().all(|p| matches!(p, Part::Text(_) | Part::Aside(_))) =>
        {
            message.content = Some(joined(&parts))
        }
        (_, parts) => message.parts = parts,
    }
    message.content.get_or_insert_default();
    message
}

#[cfg(test)]
mod tests {
    use super::super::{DEFAULT_CHAT_TEMPLATE, SpecialTokens};
    use super::*;

    /// `body`'s chat rendered with `source`, as SGLang (`sglang`) or as vLLM renders it.
    fn render(source: &str, body: &str, sglang: bool) -> Result<String, RequestError> {
        let mut template = ChatTemplate::new(source, SpecialTokens::default()).unwrap();
        if sglang {
            template.render_as_sglang();
        }
        let chat = crate::openai::ChatRequest::parse(body.as_bytes()).unwrap();
        template.render(&chat.messages, chat.variables())
    }

    const LINES: &str =
        "{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}{{ add_generation_prompt }}";

    /// Content parts are joined with a space (empty ones too) for a template that takes a
    /// string, where vLLM joins the non-empty ones with a newline.
    #[test]
    fn content_parts_are_joined_with_a_space() {
        let body = r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},
            {"type":"text","text":""},{"type":"text","text":"b"}]},
            {"role":"assistant","content":null,"tool_calls":[]},{"role":"user","content":"c"}]}"#;
        assert_eq!(render(LINES, body, true).unwrap(), "user:a  b|assistant:|user:c|True");
        assert_eq!(render(LINES, body, false).unwrap(), "user:a\nb|assistant:|user:c|True");
    }

    /// A tool turn's text parts are one string, joined with a space, for a template that
    /// loops over contents too.
    #[test]
    fn a_tool_turns_parts_are_one_string() {
        let source = "{% for m in messages %}{% if m.content is string %}{{ m.content }}\
                      {% else %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endif %}|{% endfor %}";
        let parts = r#"[{"type":"text","text":"x"},{"type":"text","text":"y"}]"#;
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":{parts}}},{{"role":"tool","tool_call_id":"1","content":{parts}}}]}}"#
        );
        assert_eq!(render(source, &body, true).unwrap(), "[x][y]|x y|");
        assert_eq!(render(source, &body, false).unwrap(), "[x][y]|x\ny|");
    }

    /// A last assistant turn is a user turn, or with `continue_final_message` the text the
    /// prompt ends with after the generation prompt; either way the generation prompt is
    /// there.
    #[test]
    fn a_last_assistant_turn_is_a_user_turn_or_continued_after_the_prompt() {
        let hi = r#"{"role":"user","content":"Hi"}"#;
        let last = r#"{"role":"assistant","content":"Hello","name":"bot"}"#;
        let ended = format!(r#"{{"messages":[{hi},{last}],"add_generation_prompt":false}}"#);
        assert_eq!(
            render(DEFAULT_CHAT_TEMPLATE, &ended, true).unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
        );
        let continued = format!(r#"{{"messages":[{hi},{last}],"continue_final_message":true}}"#);
        assert_eq!(
            render(DEFAULT_CHAT_TEMPLATE, &continued, true).unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello"
        );
        // vLLM refuses both at once (`add_generation_prompt` is true unless set to false).
        assert!(render(DEFAULT_CHAT_TEMPLATE, &continued, false).is_err());
    }

    /// An empty list of tools is none, as SGLang passes it.
    #[test]
    fn an_empty_list_of_tools_is_none() {
        let body = r#"{"messages":[{"role":"user","content":"q"}],"tools":[ ]}"#;
        assert_eq!(render("{{ tools is none }}", body, true).unwrap(), "True");
        assert_eq!(render("{{ tools is none }}", body, false).unwrap(), "False");
    }

    /// Tools reach the template as SGLang's pydantic models dump them.
    #[test]
    fn tools_are_dumped_as_sglang_dumps_them() {
        let body = r#"{"messages":[{"role":"user","content":"q"}],"tools":[{"type":"function",
            "function":{"name":"f","parameters":{"type":"object"}}},
            {"function":{"name":"g","description":"G","strict":"yes"},"defer_loading":true}]}"#;
        assert_eq!(
            render("{{ tools | tojson }}", body, true).unwrap(),
            r#"[{"type": "function", "function": {"description": null, "name": "f", "parameters": {"type": "object"}, "strict": false}, "defer_loading": null}, {"type": "function", "function": {"description": "G", "name": "g", "parameters": null, "strict": true, "defer_loading": true}, "defer_loading": true}]"#
        );
    }

    /// A reasoning effort sets `thinking` and `enable_thinking` unless the kwargs do, and
    /// reaches the template unmapped; the kwargs' own wins. Tools go for `tool_choice:
    /// "none"`, and `documents` are none.
    #[test]
    fn kwargs_tools_and_documents_are_sglangs() {
        let source = "{{ reasoning_effort }} {{ thinking }} {{ enable_thinking }} {{ tools is none }} \
                      {{ documents is none }}";
        let tools = r#""tools":[{"type":"function","function":{"name":"f"}}]"#;
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":"q"}}],"reasoning_effort":"none",{tools},
            "tool_choice":"none","documents":[{{"text":"d"}}],"chat_template_kwargs":{{"thinking":true}}}}"#
        );
        assert_eq!(render(source, &body, true).unwrap(), "none True False True True");
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":"q"}}],"reasoning_effort":"high",{tools},
            "chat_template_kwargs":{{"reasoning_effort":"low"}}}}"#
        );
        assert_eq!(render(source, &body, true).unwrap(), "low True True False True");
    }
}
