//! The flags of a vLLM server that change how it renders a chat ([`ChatOptions`]). A router
//! whose options are not its fleet's predicts prompts the replicas never cache, so the
//! router and the replica agent take them under vLLM's names, from the same environment
//! variables.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use serde_json::value::RawValue;

use super::{ContentFormat, Variables};
use crate::openai::request::REASONING_EFFORTS;

/// A JSON object, as flags and TOML give it.
pub type JsonObject = serde_json::Map<String, serde_json::Value>;

/// What `vllm serve` flags of the same names change in a chat's prompt.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct ChatOptions {
    /// Chat template variables set for every request (a JSON object, e.g.
    /// '{"enable_thinking": false}'); a request's `chat_template_kwargs` win, except where
    /// they are null or "auto". As vLLM's flag of the same name: the fleet's value.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "KVROUTE_DEFAULT_CHAT_TEMPLATE_KWARGS", value_parser = json_object)
    )]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default_chat_template_kwargs: Option<JsonObject>,
    /// A request's reasoning effort as the template is given it (a JSON object, e.g.
    /// '{"medium": "low"}'; efforts not named pass unchanged). As vLLM's flag.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "KVROUTE_REASONING_EFFORT_MAP", value_parser = effort_map)
    )]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_effort_map: Option<BTreeMap<String, String>>,
    /// Leave a request's tools out of its prompt when its `tool_choice` is "none". As
    /// vLLM's flag.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "KVROUTE_EXCLUDE_TOOLS_WHEN_TOOL_CHOICE_NONE", default_value_t = false)
    )]
    pub exclude_tools_when_tool_choice_none: bool,
    /// How templates take a message's content: read from each template ("auto"), or
    /// "string" or "openai" for all. As vLLM's flag.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "KVROUTE_CHAT_TEMPLATE_CONTENT_FORMAT", value_enum, default_value_t)
    )]
    pub chat_template_content_format: ContentFormatOption,
    /// Render a request that brings its own `chat_template` with it; without this, such a
    /// request is refused (400), as vLLM refuses it. As vLLM's flag.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "KVROUTE_TRUST_REQUEST_CHAT_TEMPLATE", default_value_t = false)
    )]
    pub trust_request_chat_template: bool,
}

/// `--chat-template-content-format`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum ContentFormatOption {
    /// Each template's own, read from its syntax tree.
    #[default]
    Auto,
    /// A string for every message.
    String,
    /// A list of parts for every message.
    Openai,
}

impl ContentFormatOption {
    /// The format every template is given, or none for each its own.
    pub fn forced(self) -> Option<ContentFormat> {
        match self {
            Self::Auto => None,
            Self::String => Some(ContentFormat::String),
            Self::Openai => Some(ContentFormat::OpenAi),
        }
    }
}

impl ChatOptions {
    /// Every problem with these options (an unknown effort in the map), as a flag's error.
    pub fn problems(&self) -> Vec<String> {
        self.reasoning_effort_map.as_ref().and_then(effort_map_problem).into_iter().collect()
    }

    /// The effort a template is given for a request's `effort` (`--reasoning-effort-map`).
    pub fn effort<'a>(&'a self, effort: Option<&'a str>) -> Option<&'a str> {
        let effort = effort?;
        Some(
            self.reasoning_effort_map.as_ref().and_then(|map| map.get(effort)).map_or(effort, String::as_str),
        )
    }

    /// The request's tools as vLLM renders its chat: none for `tool_choice: "none"` when
    /// the fleet leaves them out (`--exclude-tools-when-tool-choice-none`).
    pub fn tools<'a>(&self, vars: &Variables<'a>) -> Option<&'a RawValue> {
        vars.tools.filter(|_| !(vars.tool_choice_none && self.exclude_tools_when_tool_choice_none))
    }
}

fn effort_map_problem(map: &BTreeMap<String, String>) -> Option<String> {
    let unknown: Vec<&str> =
        map.keys().map(String::as_str).filter(|k| !REASONING_EFFORTS.contains(k)).collect();
    (!unknown.is_empty()).then(|| {
        format!(
            "--reasoning-effort-map has unknown efforts {unknown:?}; keys must be one of {REASONING_EFFORTS:?}"
        )
    })
}

/// A flag's JSON object.
#[cfg(feature = "cli")]
fn json_object(text: &str) -> Result<JsonObject, String> {
    serde_json::from_str(text).map_err(|e| format!("not a JSON object: {e}"))
}

/// `--reasoning-effort-map`: a JSON object of efforts to strings.
#[cfg(feature = "cli")]
fn effort_map(text: &str) -> Result<BTreeMap<String, String>, String> {
    let map = serde_json::from_str(text).map_err(|e| format!("not a JSON object of strings: {e}"))?;
    effort_map_problem(&map).map_or(Ok(map), Err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::chat_template::{ChatTemplate, SpecialTokens};
    use crate::openai::{ChatRequest, RequestError};

    fn render(source: &str, options: &ChatOptions, fields: &str) -> Result<String, RequestError> {
        let template =
            ChatTemplate::new(source, SpecialTokens::default()).unwrap().with_options(options.clone());
        let body = format!(r#"{{"messages":[{{"role":"user","content":"hi"}}]{fields}}}"#);
        let chat = ChatRequest::parse(body.as_bytes())?;
        template.render(&chat.messages, chat.variables())
    }

    fn kwargs(json: &str) -> Option<JsonObject> {
        Some(serde_json::from_str(json).unwrap())
    }

    /// `--default-chat-template-kwargs` as vLLM 0.33 merges it (`merge_kwargs`): under the
    /// request's kwargs and fields, where null and "auto" leave the default.
    #[test]
    fn default_kwargs_are_under_the_requests() {
        let source = "{{ enable_thinking }} {{ x }} {{ y is defined }}";
        let options = ChatOptions {
            default_chat_template_kwargs: kwargs(r#"{"enable_thinking": false, "x": 1}"#),
            ..ChatOptions::default()
        };
        assert_eq!(render(source, &options, "").unwrap(), "False 1 False");
        assert_eq!(render(source, &ChatOptions::default(), "").unwrap(), "  False", "no defaults");
        let with = |k: &str| render(source, &options, &format!(r#","chat_template_kwargs":{k}"#)).unwrap();
        assert_eq!(with(r#"{"enable_thinking": true, "y": 0}"#), "True 1 True");
        assert_eq!(with(r#"{"enable_thinking": null, "x": "auto", "y": null}"#), "False 1 False");
        // A reasoning effort sets enable_thinking over the default, as a request field.
        assert_eq!(render(source, &options, r#","reasoning_effort":"high""#).unwrap(), "True 1 False");
        // The request's tools win over a default `tools`; the default stands without them.
        let with_tools =
            ChatOptions { default_chat_template_kwargs: kwargs(r#"{"tools": "D"}"#), ..options.clone() };
        let tools = r#","tools":[{"type":"function","function":{"name":"f"}}]"#;
        assert_eq!(render("{{ tools is string }}", &with_tools, tools).unwrap(), "False");
        assert_eq!(render("{{ tools is string }}", &with_tools, "").unwrap(), "True");
        // Null and "auto" kwargs are left out with no defaults too (vLLM always merges).
        let none =
            render("{{ y is defined }}", &ChatOptions::default(), r#","chat_template_kwargs":{"y":null}"#);
        assert_eq!(none.unwrap(), "False");
    }

    /// `--reasoning-effort-map` rewrites the effort the template sees, and enable_thinking
    /// follows the rewritten one.
    #[test]
    fn the_effort_map_rewrites_the_requests_effort() {
        let options = ChatOptions {
            reasoning_effort_map: Some(
                [("medium".into(), "low".into()), ("low".into(), "none".into())].into(),
            ),
            ..ChatOptions::default()
        };
        let source = "{{ reasoning_effort }} {{ enable_thinking }}";
        let effort = |e: &str| render(source, &options, &format!(r#","reasoning_effort":"{e}""#)).unwrap();
        assert_eq!(effort("medium"), "low True");
        assert_eq!(effort("low"), "none False");
        assert_eq!(effort("high"), "high True");
        assert!(options.problems().is_empty());
        let bad =
            ChatOptions { reasoning_effort_map: Some([("huge".into(), "max".into())].into()), ..options };
        assert_eq!(bad.problems().len(), 1, "an effort vLLM does not know");
    }

    /// `--exclude-tools-when-tool-choice-none`: tools reach the template unless tool_choice
    /// is "none" and the flag is set.
    #[test]
    fn tools_are_left_out_for_tool_choice_none_when_asked() {
        let source = "{{ tools is none }}";
        let exclude = ChatOptions { exclude_tools_when_tool_choice_none: true, ..ChatOptions::default() };
        let tools = r#","tools":[{"type":"function","function":{"name":"f"}}]"#;
        let with = |options: &ChatOptions, choice: &str| {
            render(source, options, &format!(r#"{tools},"tool_choice":{choice}"#)).unwrap()
        };
        assert_eq!(with(&exclude, r#""none""#), "True");
        assert_eq!(with(&exclude, r#""auto""#), "False");
        assert_eq!(with(&ChatOptions::default(), r#""none""#), "False");
    }

    /// `--chat-template-content-format` gives every template that format, whatever it reads.
    /// (A part prints as Jinja2 prints vLLM's dict: `type` first.)
    #[test]
    fn a_forced_content_format_overrides_the_templates() {
        let source = "{% for m in messages %}{{ m.content }}{% endfor %}";
        let forced = ChatOptions {
            chat_template_content_format: ContentFormatOption::Openai,
            ..ChatOptions::default()
        };
        assert_eq!(render(source, &ChatOptions::default(), "").unwrap(), "hi");
        assert_eq!(render(source, &forced, "").unwrap(), "[{'type': 'text', 'text': 'hi'}]");
    }

    /// A request's own template is refused unless trusted (with vLLM's 400), also when it
    /// comes in the kwargs; trusted, it renders the request.
    #[test]
    fn a_requests_template_is_used_only_when_trusted() {
        let own = r#","chat_template":"{{ messages[0].content | upper }}!""#;
        let source = "{{ messages[0].content }}";
        assert!(matches!(
            render(source, &ChatOptions::default(), own),
            Err(RequestError::UntrustedChatTemplate)
        ));
        let in_kwargs = r#","chat_template_kwargs":{"chat_template":"x"}"#;
        assert!(matches!(
            render(source, &ChatOptions::default(), in_kwargs),
            Err(RequestError::UntrustedChatTemplate)
        ));
        assert_eq!(render(source, &ChatOptions::default(), r#","chat_template":null"#).unwrap(), "hi");
        let trust = ChatOptions { trust_request_chat_template: true, ..ChatOptions::default() };
        assert_eq!(render(source, &trust, own).unwrap(), "HI!");
        // vLLM renders with the kwarg's template when it has no --chat-template of its own.
        assert_eq!(render(source, &trust, in_kwargs).unwrap(), "x");
        assert!(matches!(
            render(source, &trust, r#","chat_template":"{% if %}""#),
            Err(RequestError::Template(_))
        ));
        // One that runs too long is stopped, as vLLM stops it (its instruction limit).
        let endless = r#","chat_template":"{% for i in range(100000) %}{% for j in range(100) %}x{% endfor %}{% endfor %}""#;
        assert!(matches!(render(source, &trust, endless), Err(RequestError::Template(_))));
        // An empty one is none when trusted (vLLM's `or`), and refused when not.
        assert_eq!(render(source, &trust, r#","chat_template":"""#).unwrap(), "hi");
        assert!(render(source, &ChatOptions::default(), r#","chat_template":"""#).is_err());
    }

    /// A trusted template in a request's kwargs renders it as vLLM 0.33 chooses: under the
    /// request's own, not at all when the replicas have a `--chat-template`, unless the
    /// request's own is "auto"; in the content format of the template it replaces.
    #[test]
    fn a_kwargs_template_is_used_as_vllm_chooses() {
        let trust = ChatOptions { trust_request_chat_template: true, ..ChatOptions::default() };
        let model = "{{ messages[0].content }}";
        let template = |flag: bool| {
            let t = ChatTemplate::new(model, SpecialTokens::default()).unwrap().with_options(trust.clone());
            if flag { t.as_chat_template_flag() } else { t }
        };
        let render = |template: &ChatTemplate, fields: &str| {
            let body = format!(r#"{{"messages":[{{"role":"user","content":"hi"}}]{fields}}}"#);
            let chat = ChatRequest::parse(body.as_bytes())?;
            template.render(&chat.messages, chat.variables())
        };
        let (model_own, flag) = (template(false), template(true));
        let k = r#","chat_template_kwargs":{"chat_template":"K{{ messages[0].content }}"}"#;
        assert_eq!(render(&model_own, k).unwrap(), "Khi");
        assert_eq!(render(&flag, k).unwrap(), "hi", "the replicas' --chat-template wins");
        let own_and_k = format!(r#"{k},"chat_template":"T""#);
        assert_eq!(render(&model_own, &own_and_k).unwrap(), "T");
        let auto_and_k = format!(r#"{k},"chat_template":"auto""#);
        assert_eq!(render(&flag, &auto_and_k).unwrap(), "Khi", "'auto' skips the flag");
        let empty_and_k = format!(r#"{k},"chat_template":"""#);
        assert_eq!(render(&model_own, &empty_and_k).unwrap(), "Khi");
        assert_eq!(render(&flag, &empty_and_k).unwrap(), "hi");
        for none in [r#"null"#, r#""auto""#, r#""""#] {
            let fields = format!(r#","chat_template_kwargs":{{"chat_template":{none}}}"#);
            assert_eq!(render(&model_own, &fields).unwrap(), "hi", "{none}");
        }
        let number = r#","chat_template_kwargs":{"chat_template":3}"#;
        assert!(matches!(render(&model_own, number), Err(RequestError::Template(_))));
        // The content: a string, as the model's template takes it, though the kwarg's
        // template loops over parts (its own format would be "openai").
        let looping = r#","chat_template_kwargs":{"chat_template":"{% for m in messages %}{% for p in m.content %}[{{ p }}]{% endfor %}{% endfor %}"}"#;
        assert_eq!(render(&model_own, looping).unwrap(), "[h][i]");
        let own_looping = r#","chat_template":"{% for m in messages %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endfor %}""#;
        assert_eq!(render(&model_own, own_looping).unwrap(), "[hi]", "a request's own: its format");
    }

    /// The content format vLLM reads for a request's own template of "auto" (the text
    /// "auto": "string") and for one whose tools `tool_choice: "none"` drops (the default
    /// template's, not the `tool_use` one's).
    #[test]
    fn the_content_format_follows_vllms_choice_of_template() {
        let looping = "{% for m in messages %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endfor %}";
        let trust = ChatOptions { trust_request_chat_template: true, ..ChatOptions::default() };
        assert_eq!(render(looping, &trust, "").unwrap(), "[hi]", "the template's own format: openai");
        let auto = r#","chat_template":"auto""#;
        assert_eq!(render(looping, &trust, auto).unwrap(), "[][]", "'auto': the string format");

        let dir = std::env::temp_dir().join(format!("kvroute-none-tools-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokenizer_config.json");
        let config = serde_json::json!({ "chat_template": [{"name": "default", "template": looping},
            {"name": "tool_use", "template": "{% for m in messages %}{{ m.content }}{% endfor %}"}] });
        std::fs::write(&path, config.to_string()).unwrap();
        let exclude = ChatOptions {
            exclude_tools_when_tool_choice_none: true,
            trust_request_chat_template: true,
            ..trust
        };
        let template = ChatTemplate::from_tokenizer_config(&path).unwrap().with_options(exclude);
        std::fs::remove_dir_all(dir).ok();
        // A kwarg template, read in the format of the template it replaces: the default one,
        // as the tools are gone.
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":"hi"}}],"tool_choice":"none",
            "tools":[{{"type":"function","function":{{"name":"f"}}}}],"chat_template_kwargs":{{"chat_template":{}}}}}"#,
            serde_json::to_string(looping).unwrap()
        );
        let chat = ChatRequest::parse(body.as_bytes()).unwrap();
        assert_eq!(template.render(&chat.messages, chat.variables()).unwrap(), "[hi]");
    }

    /// A trusted request's `chat_template` naming one of the model's templates picks it, as
    /// transformers picks a named template.
    #[test]
    fn a_requests_template_may_name_one_of_the_models() {
        let dir = std::env::temp_dir().join(format!("kvroute-named-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokenizer_config.json");
        let config = r#"{"chat_template":[{"name":"default","template":"D{{ tools is none }}"},
            {"name":"tool_use","template":"T{{ tools is none }}"}]}"#;
        std::fs::write(&path, config).unwrap();
        let trust = ChatOptions { trust_request_chat_template: true, ..ChatOptions::default() };
        let template = ChatTemplate::from_tokenizer_config(&path).unwrap().with_options(trust);
        std::fs::remove_dir_all(dir).ok();
        let render = |fields: &str| {
            let body = format!(r#"{{"messages":[{{"role":"user","content":"hi"}}]{fields}}}"#);
            let chat = ChatRequest::parse(body.as_bytes()).unwrap();
            template.render(&chat.messages, chat.variables()).unwrap()
        };
        assert_eq!(render(""), "DTrue");
        assert_eq!(render(r#","chat_template":"tool_use""#), "TTrue");
        let tools = r#","tools":[{"type":"function","function":{"name":"f"}}]"#;
        assert_eq!(render(tools), "TFalse");
        assert_eq!(render(&format!(r#"{tools},"chat_template":"default""#)), "DFalse");
        assert_eq!(render(r#","chat_template":"other""#), "other", "not a name: a template");
    }
}
