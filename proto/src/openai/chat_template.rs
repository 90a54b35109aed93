//! Chat messages to a prompt string, rendered the way vLLM (through Hugging Face
//! `apply_chat_template`) renders them, so the router's prompt matches the replica's.
//!
//! The Jinja environment copies transformers' settings: `trim_blocks` and `lstrip_blocks`
//! on, loop controls (`{% break %}`) available, Python string methods (`.strip()`,
//! `.startswith()`, ... via minijinja-contrib's pycompat), `raise_exception(msg)`,
//! `strftime_now(fmt)` (local time), and a `tojson` filter that writes what Python's `json.dumps`
//! writes with transformers' arguments (`ensure_ascii`, `indent`, `separators`, `sort_keys`;
//! by default `", "`/`": "` separators, non-ASCII kept, key order kept).
//!
//! Template variables: `messages`, each as vLLM (0.33) passes it (`parse_chat_messages`):
//! `role`; `content`, a string (`""` when the client sent none), or for a template that
//! loops over it (vLLM's "openai" content format, [`ContentFormat`]) a list of text parts
//! (empty when the client sent none), except a tool message's, whose text parts are joined
//! into one string with newlines (empty ones too); an assistant's non-empty
//! `tool_calls`, each call's `function.arguments` parsed from its JSON string (`{}` when it
//! is not JSON), and its `reasoning` (passed under `reasoning_content` too); a tool
//! message's `tool_call_id` (null included); a string `name`; a string `task`; a developer
//! message's `tools` (null when it has none); in that order, and no other key of the
//! client's. A system message's text has Claude Code's attribution line left out
//! (`request::messages`). For a template that does not name the `developer` role (as
//! `"developer"` or `'developer'`), developer messages are system ones, and then, if a
//! system message is not the first, all of them are merged into one first one
//! (vLLM's `_convert_developer_to_system`, `_consolidate_system_messages`). Then
//! `tools` (the request's, or none),
//! `documents` (none), the named special tokens the tokenizer config sets ([`SpecialTokens`]:
//! `bos_token`, `eos_token`, ..., none when unset), then the fleet's
//! default kwargs ([`ChatOptions`]) and over them every key of the request's `chat_template_kwargs` that is
//! not null or "auto" (which may override those), with `add_generation_prompt`, the
//! request's `documents` if it has some and its reasoning effort over its kwargs (the
//! request's own fields win, as vLLM 0.33 merges them).
//!
//! The vLLM server flags that change a chat's prompt are [`ChatOptions`]: default kwargs,
//! the reasoning effort map, tools left out for `tool_choice: "none"`, a content format for
//! every template, and whether a request may bring its own template (rendered with it,
//! compiled once; otherwise refused as vLLM refuses it). A trusted request's template is
//! chosen as vLLM 0.33 chooses: its `chat_template` (empty is none); else, unless the
//! replicas have a `--chat-template` (the router's `chat_template` setting), the one in its
//! `chat_template_kwargs`, read in the content format of the template it replaces. A
//! request's own `"auto"` skips the replicas' flag, where vLLM then renders the model's own
//! template (the tokenizer's), and the router the one it has.
//!
//! `continue_final_message` ends the prompt inside the last message, as transformers (5.16
//! to 5.20, vLLM 0.33's) does it: the text the prompt ends in (the last message's content,
//! or its last text part in the "openai" format) is rendered with a tag after it, and the
//! prompt cut where the tag begins.
//!
//! A model with named templates renders with its `default` one, and with its `tool_use`
//! one (if it has one) for a request with tools, as transformers chooses; each has its own
//! content format.
//!
//! [`ChatTemplate::builtin_default`] is the ChatML template ([`DEFAULT_CHAT_TEMPLATE`]) that
//! goes with the builtin tokenizer, so the router and the agents render identically with no
//! configuration at all.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use minijinja::value::Kwargs;
use minijinja::value::ValueKind;
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::Deserialize;
use serde::ser::{SerializeMap, Serializer};
use serde_json::value::RawValue;

use super::error::{LoadError, RequestError};

mod content_format;
mod generation_tag;
mod options;
mod python_float;
mod sglang;

use super::request::{Message, Part};
pub use content_format::ContentFormat;
pub use options::{ChatOptions, ContentFormatOption, JsonObject};

/// ChatML, as Qwen and many others use it: one `<|im_start|>{role}\n{content}<|im_end|>\n`
/// block per message, then `<|im_start|>assistant\n` when a generation prompt is asked for.
/// A message whose content is none renders with empty content.
pub const DEFAULT_CHAT_TEMPLATE: &str = "\
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\\n' }}
    {%- if message.content is string %}{{ message.content }}{% endif %}
    {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
";

const TEMPLATE_NAME: &str = "chat";
const TOOL_USE_TEMPLATE_NAME: &str = "chat_tool_use";

/// The named special tokens a template may print, as transformers (5.20) passes them
/// (`special_tokens_map` and the model's own named ones): `bos_token`, `eos_token`,
/// `unk_token`, `sep_token`, `pad_token`, `cls_token`, `mask_token`, and any other
/// `*_token` the tokenizer config names (e.g. `image_token`). A name the tokenizer does not
/// set is not a variable at all: `{{ bos_token }}` prints nothing, and
/// `bos_token is defined` is false.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// By name, the token's text.
    pub named: BTreeMap<String, String>,
}

/// The named special tokens every transformers tokenizer has a place for.
const STANDARD_SPECIAL_TOKENS: [&str; 7] =
    ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];

impl SpecialTokens {
    /// These names and texts.
    pub fn new<'a>(named: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        Self { named: named.into_iter().map(|(n, t)| (n.to_owned(), t.to_owned())).collect() }
    }

    /// The builtin tokenizer's: no BOS, `<|im_end|>` ends a turn.
    pub fn builtin() -> Self {
        Self::new([("eos_token", "<|im_end|>")])
    }

    /// The named special tokens of a Hugging Face `tokenizer_config.json`.
    pub fn from_tokenizer_config(path: impl AsRef<Path>) -> Result<Self, LoadError> {
        Ok(TokenizerConfigFile::load(path.as_ref())?.special_tokens(SpecialTokens::default()))
    }

    /// The text of the token named `name`, if the tokenizer sets it.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.named.get(name).map(String::as_str)
    }
}

/// Whether a Hugging Face `tokenizer_config.json` says to put its BOS in front of a text and
/// its EOS after it (`add_bos_token`, `add_eos_token`), when it says either: transformers 5
/// then builds the post-processor from these (an absent one is false) in place of
/// `tokenizer.json`'s.
pub fn bos_eos_flags(path: impl AsRef<Path>) -> Result<Option<(bool, bool)>, LoadError> {
    let file = TokenizerConfigFile::load(path.as_ref())?;
    let flag = |key| file.rest.get(key).map(|v| v.as_bool() == Some(true));
    Ok(match (flag("add_bos_token"), flag("add_eos_token")) {
        (None, None) => None,
        (bos, eos) => Some((bos.unwrap_or(false), eos.unwrap_or(false))),
    })
}

/// Why a template does not render a continued final message with a generation prompt (as
/// transformers refuses it).
pub(crate) const CONTINUE_WITH_GENERATION_PROMPT: &str = "continue_final_message and add_generation_prompt are \
     not compatible (`add_generation_prompt` is true unless set to false)";

/// A compiled chat template plus the special tokens it is rendered with.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    special: SpecialTokens,
    /// The template, and the one for requests with tools if the model has one apart (a
    /// `tool_use` template, which transformers chooses when a request has tools).
    default: Facts,
    tool_use: Option<Facts>,
    /// The fleet's flags ([`ChatOptions`]).
    options: Arc<ChatOptions>,
    /// Templates requests brought, compiled, by source; none in such a template itself.
    requested: Option<quick_cache::sync::Cache<String, Arc<ChatTemplate>>>,
    /// Whether this is the replicas' `--chat-template` rather than the model's own.
    is_flag: bool,
    /// Rendered as SGLang renders ([`sglang`]).
    sglang: bool,
}

/// Templates of requests kept compiled (`trust_request_chat_template`).
const REQUESTED_TEMPLATES: usize = 16;

/// Instructions a request's own template may run in one rendering (vLLM's
/// `VLLM_CHAT_TEMPLATE_FUEL` default for the same MiniJinja limit); the model's templates
/// have none.
const REQUESTED_TEMPLATE_FUEL: u64 = 500_000;

/// What is read from a template's source, besides compiling it.
#[derive(Debug)]
struct Facts {
    /// Its name in the environment.
    name: &'static str,
    format: ContentFormat,
    /// Whether the source says `content` anywhere (transformers' test of whether it can
    /// continue a final message).
    mentions_content: bool,
    /// Whether the source names the `developer` role as a string (vLLM's test of whether
    /// the template takes it; otherwise developer turns become system ones).
    knows_developer: bool,
    /// Whether it writes OpenAI's Harmony format (`<|start|>`, `<|channel|>`): gpt-oss's.
    harmony: bool,
}

/// The fields of a Hugging Face `tokenizer_config.json` that matter here: the template,
/// and the rest for the named special tokens.
#[derive(Deserialize)]
struct TokenizerConfigFile {
    chat_template: Option<TemplateField>,
    #[serde(flatten)]
    rest: serde_json::Map<String, serde_json::Value>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum TemplateField {
    One(String),
    Named(Vec<NamedTemplate>),
}

#[derive(Deserialize)]
struct NamedTemplate {
    name: String,
    template: String,
}

/// `"bos_token": "<s>"` or `"bos_token": {"content": "<s>", ...}`.
#[derive(Deserialize)]
#[serde(untagged)]
enum TokenField {
    Text(String),
    Added { content: String },
}

impl TokenizerConfigFile {
    fn load(path: &Path) -> Result<Self, LoadError> {
        serde_json::from_slice(&read(path)?)
            .map_err(|source| LoadError::TokenizerConfig { path: path.into(), source })
    }

    /// The file's named special tokens, over `fallback`'s, as transformers 5.20 reads them:
    /// the standard names, any other `*_token` whose value is a token (a string, or an
    /// object of `"__type": "AddedToken"`), and the entries of an `extra_special_tokens`
    /// object (else of an `additional_special_tokens` one), which win over the `*_token`
    /// keys. A null is unset.
    fn special_tokens(&self, fallback: SpecialTokens) -> SpecialTokens {
        let token =
            |value: &serde_json::Value| TokenField::deserialize(value).ok().map(TokenField::into_string);
        let added_token = |value: &serde_json::Value| match value {
            serde_json::Value::Object(o)
                if o.get("__type").and_then(|t| t.as_str()) != Some("AddedToken") =>
            {
                None
            }
            other => token(other),
        };
        let mut named = fallback.named;
        let mut model_specific = BTreeMap::new();
        for (key, value) in &self.rest {
            if STANDARD_SPECIAL_TOKENS.contains(&key.as_str()) {
                match token(value) {
                    Some(text) => named.insert(key.clone(), text),
                    None => named.remove(key),
                };
            } else if key.ends_with("_token")
                && let Some(text) = added_token(value)
            {
                model_specific.insert(key.clone(), text);
            }
        }
        // transformers takes `additional_special_tokens` for `extra_special_tokens` when that
        // is absent or empty.
        let given = |key| {
            self.rest.get(key).filter(|v| match v {
                serde_json::Value::Null => false,
                serde_json::Value::Object(o) => !o.is_empty(),
                serde_json::Value::Array(a) => !a.is_empty(),
                _ => true,
            })
        };
        let extra = given("extra_special_tokens").or_else(|| given("additional_special_tokens"));
        if let Some(serde_json::Value::Object(extra)) = extra {
            model_specific.extend(extra.iter().filter_map(|(k, v)| Some((k.clone(), added_token(v)?))));
        }
        named.extend(model_specific);
        SpecialTokens { named }
    }
}

impl TokenField {
    fn into_string(self) -> String {
        match self {
            TokenField::Text(s) | TokenField::Added { content: s } => s,
        }
    }
}

impl ChatTemplate {
    /// Compiles `source` (Jinja) to be rendered with `special`.
    pub fn new(source: impl Into<String>, special: SpecialTokens) -> Result<Self, LoadError> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(LoadError::Template)?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_filter("string", string);
        env.set_formatter(write_value);
        let default = Facts::add(&mut env, TEMPLATE_NAME, source.into())?;
        Ok(Self {
            env,
            special,
            default,
            tool_use: None,
            options: Arc::default(),
            requested: Some(quick_cache::sync::Cache::new(REQUESTED_TEMPLATES)),
            is_flag: false,
            sglang: false,
        })
    }

    /// This template, as the fleet's replicas' `--chat-template` (vLLM's flag) rather than
    /// the model's own: a template in a request's `chat_template_kwargs` is then not used.
    pub fn as_chat_template_flag(mut self) -> Self {
        self.is_flag = true;
        self
    }

    /// Renders chats as SGLang renders them ([`sglang`]), not as vLLM does.
    pub fn render_as_sglang(&mut self) {
        self.sglang = true;
    }

    /// Whether chats are rendered as SGLang renders them.
    pub fn renders_as_sglang(&self) -> bool {
        self.sglang
    }

    /// This template, rendered as a vLLM server with `options` renders.
    pub fn with_options(mut self, options: ChatOptions) -> Self {
        self.options = Arc::new(options);
        self.apply_options();
        self
    }

    fn apply_options(&mut self) {
        if let Some(format) = self.options.chat_template_content_format.forced() {
            self.default.format = format;
            if let Some(tool_use) = &mut self.tool_use {
                tool_use.format = format;
            }
        }
    }

    /// The fleet's flags this template is rendered with.
    pub fn options(&self) -> &ChatOptions {
        &self.options
    }

    /// This template, with `source` for requests with tools.
    fn with_tool_use(mut self, source: String) -> Result<Self, LoadError> {
        self.tool_use = Some(Facts::add(&mut self.env, TOOL_USE_TEMPLATE_NAME, source)?);
        self.apply_options();
        Ok(self)
    }

    /// The documented ChatML default for the builtin tokenizer.
    pub fn builtin_default() -> Self {
        // The constant template is covered by tests; compiling it cannot fail.
        Self::new(DEFAULT_CHAT_TEMPLATE, SpecialTokens::builtin()).expect("default chat template compiles")
    }

    /// Loads a template file: a `*.json` is read as a `tokenizer_config.json` or a
    /// `chat_template.json` (see [`ChatTemplate::from_tokenizer_config`]; special tokens it
    /// does not name are `special`'s), anything else as raw Jinja rendered with `special`.
    pub fn from_file(path: impl AsRef<Path>, special: SpecialTokens) -> Result<Self, LoadError> {
        let path = path.as_ref();
        if path.extension().is_some_and(|e| e == "json") {
            return Self::from_config_file(path, special);
        }
        let source = read(path)?;
        Self::new(String::from_utf8_lossy(&source).into_owned(), special)
    }

    /// Loads the model's chat template (the one named `default` if there are several, and
    /// the one named `tool_use` for requests with tools if there is one) and named special
    /// tokens from a Hugging Face `tokenizer_config.json`. As transformers 5.20 loads them,
    /// template files beside it win over its `chat_template`: `chat_template.jinja` (the
    /// default) and `additional_chat_templates/tool_use.jinja`.
    pub fn from_tokenizer_config(path: impl AsRef<Path>) -> Result<Self, LoadError> {
        let path = path.as_ref();
        let dir = path.parent().unwrap_or(Path::new("."));
        let beside = |file: &Path| -> Result<Option<String>, LoadError> {
            match file.is_file() {
                true => Ok(Some(String::from_utf8_lossy(&read(file)?).into_owned())),
                false => Ok(None),
            }
        };
        let default = beside(&dir.join("chat_template.jinja"))?;
        let tool_use = beside(&dir.join("additional_chat_templates").join("tool_use.jinja"))?;
        if default.is_none() && tool_use.is_none() {
            return Self::from_config_file(path, SpecialTokens::default());
        }
        let special = TokenizerConfigFile::load(path)?.special_tokens(SpecialTokens::default());
        let default =
            default.ok_or_else(|| LoadError::NoChatTemplate { path: dir.join("chat_template.jinja") })?;
        let template = Self::new(default, special)?;
        match tool_use {
            Some(tool_use) => template.with_tool_use(tool_use),
            None => Ok(template),
        }
    }

    /// A JSON file's `chat_template`, with its special tokens, else `fallback`'s (Hugging
    /// Face's `chat_template.json` holds the template alone).
    fn from_config_file(path: &Path, fallback: SpecialTokens) -> Result<Self, LoadError> {
        let config = TokenizerConfigFile::load(path)?;
        let special = config.special_tokens(fallback);
        let (source, tool_use) = match config.chat_template {
            Some(TemplateField::One(t)) => (t, None),
            Some(TemplateField::Named(mut list)) => {
                let mut take = |name: &str| {
                    let at = list.iter().position(|t| t.name == name)?;
                    Some(list.swap_remove(at).template)
                };
                let default =
                    take("default").ok_or_else(|| LoadError::NoChatTemplate { path: path.into() })?;
                (default, take("tool_use"))
            }
            None => return Err(LoadError::NoChatTemplate { path: path.into() }),
        };
        let template = Self::new(source, special)?;
        match tool_use {
            Some(tool_use) => template.with_tool_use(tool_use),
            None => Ok(template),
        }
    }

    /// Whether this is a template in OpenAI's Harmony format (gpt-oss's). vLLM 0.33 does not
    /// render such a model's chats with its template but with Harmony itself, which agrees
    /// with the template at most up to the system prompt's last token (when the date and
    /// the reasoning effort agree) and differs after it.
    pub fn is_harmony(&self) -> bool {
        self.default.harmony
    }

    /// The special tokens this template is rendered with.
    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    /// How the template takes a message's content (the default template, for requests
    /// without tools).
    pub fn content_format(&self) -> ContentFormat {
        self.default.format
    }

    /// The template a request renders with: the `tool_use` one when it has tools and the
    /// model has one.
    fn facts(&self, vars: &Variables<'_>) -> &Facts {
        match (&self.tool_use, vars.tools) {
            (Some(tool_use), Some(_)) => tool_use,
            _ => &self.default,
        }
    }

    /// Renders `messages` to the prompt string (the content of a message with media is its
    /// text alone).
    pub fn render(&self, messages: &[Message<'_>], vars: Variables<'_>) -> Result<String, RequestError> {
        self.render_as(messages, vars, false)
    }

    /// [`ChatTemplate::render`], but a message with media ([`Message::media`]) has for content
    /// a list of parts as vLLM passes them to a template that takes OpenAI-style content: the
    /// media's `{"type": "image"}` (or `"audio"`, `"video"`), then `{"type": "text", "text":
    /// ...}`. A template that does something else when a conversation has media shows it
    /// here.
    pub fn render_with_media(
        &self,
        messages: &[Message<'_>],
        vars: Variables<'_>,
    ) -> Result<String, RequestError> {
        self.render_as(messages, vars, true)
    }

    fn render_as(
        &self,
        messages: &[Message<'_>],
        mut vars: Variables<'_>,
        media_parts: bool,
    ) -> Result<String, RequestError> {
        if vars.beginning {
            (vars.add_generation_prompt, vars.continue_final_message) = (false, false);
        }
        if vars.continue_final_message && vars.add_generation_prompt && !self.sglang {
            return Err(RequestError::CannotContinue(CONTINUE_WITH_GENERATION_PROMPT));
        }
        // vLLM drops the tools before it picks a template and reads its content format;
        // SGLang drops them for `tool_choice: "none"` whatever the flag.
        vars.tools = match self.sglang {
            // (An empty list is none to SGLang.)
            true => vars.tools.filter(|t| !vars.tool_choice_none && !is_empty_list(t)),
            false => self.options.tools(&vars),
        };
        // vLLM reads the content format of the request's own template, and "auto" read as a
        // template is the text "auto", whose format is "string".
        let auto = (vars.chat_template == Some("auto"))
            .then(|| self.options.chat_template_content_format.forced().unwrap_or(ContentFormat::String));
        let mut named = None;
        match self.requested_source(&mut vars)? {
            None => {}
            // The name of one of the model's templates picks it, as transformers does.
            Some((source, _)) if source == "default" && self.tool_use.is_some() => {
                named = Some(&self.default)
            }
            Some((source, _)) if source == "tool_use" && self.tool_use.is_some() => {
                named = self.tool_use.as_ref()
            }
            Some((source, from_kwargs)) => {
                // A kwarg template is read in the format of the template it replaces.
                let format = auto.or_else(|| from_kwargs.then(|| self.facts(&vars).format));
                return self.requested(&source)?.render_chosen(None, format, messages, vars, media_parts);
            }
        }
        self.render_chosen(named, auto, messages, vars, media_parts)
    }

    /// The template a request brings, as vLLM 0.33 chooses it: its own `chat_template`
    /// (empty is none); else, when the fleet's replicas have no `--chat-template`
    /// ([`ChatTemplate::as_chat_template_flag`]), the one in its `chat_template_kwargs`;
    /// `"auto"` is none, and as the request's own it skips the fleet's flag. Whether it came
    /// from the kwargs.
    fn requested_source<'v>(
        &self,
        vars: &mut Variables<'v>,
    ) -> Result<Option<(Cow<'v, str>, bool)>, RequestError> {
        let own = vars.chat_template.take();
        if !self.options.trust_request_chat_template {
            // The kwargs' template is refused with the kwargs (`kwargs`).
            return match own {
                Some(_) => Err(RequestError::UntrustedChatTemplate),
                None => Ok(None),
            };
        }
        let from_kwargs = || {
            Ok::<_, RequestError>(kwargs_template(vars.chat_template_kwargs)?.map(|k| (Cow::Owned(k), true)))
        };
        match own {
            Some(source) if !source.is_empty() && source != "auto" => {
                Ok(Some((Cow::Borrowed(source), false)))
            }
            Some("auto") => from_kwargs(),
            _ if self.is_flag => Ok(None),
            _ => from_kwargs(),
        }
    }

    /// Renders with `named` (else the template [`ChatTemplate::facts`] picks), in `format`
    /// (else that template's).
    fn render_chosen(
        &self,
        named: Option<&Facts>,
        format: Option<ContentFormat>,
        messages: &[Message<'_>],
        vars: Variables<'_>,
        media_parts: bool,
    ) -> Result<String, RequestError> {
        let facts = named.unwrap_or_else(|| self.facts(&vars));
        let format = format.unwrap_or(facts.format);
        if self.sglang {
            return self.render_sglang(facts, format, messages, vars, media_parts);
        }
        let mut passed = facts.passed(messages, format);
        let continued_text = match (vars.continue_final_message, passed.last_mut()) {
            (true, Some(last)) => {
                let (tagged, text) = facts.tagged(&last.message, last.format(format))?;
                last.message = Cow::Owned(tagged);
                Some(text)
            }
            _ => None,
        };
        let messages = passed
            .iter()
            .map(|p| message_value(&p.message, media_parts, p.format(format)))
            .collect::<Result<Vec<_>, _>>()?;
        let rendered = self.render_context(facts, self.kwargs(&vars)?, messages)?;
        match continued_text {
            Some(text) => continued(rendered, &text),
            None => Ok(rendered),
        }
    }

    /// Renders `facts`' template with `messages` (each as the template sees it), the named
    /// special tokens and `kwargs`.
    fn render_context(
        &self,
        facts: &Facts,
        kwargs: BTreeMap<String, Value>,
        messages: Vec<Value>,
    ) -> Result<String, RequestError> {
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        ctx.insert("tools".into(), Value::from(()));
        ctx.insert("documents".into(), Value::from(()));
        for (name, text) in &self.special.named {
            ctx.insert(name.clone(), Value::from(text.as_str()));
        }
        ctx.extend(kwargs);
        ctx.insert("messages".into(), Value::from(messages));
        let template = self.env.get_template(facts.name).map_err(RequestError::Template)?;
        template.render(Value::from(ctx)).map_err(RequestError::Template)
    }
}

impl ChatTemplate {
    /// The template variables the request's fields and `chat_template_kwargs` set, merged
    /// as vLLM 0.33 merges them: the request's fields (`add_generation_prompt`, its
    /// `documents` when it has some, its reasoning effort through the effort map, with
    /// `enable_thinking` unless its kwargs set that) over its kwargs, then all that over
    /// the fleet's default kwargs, where a value that is null or "auto" leaves the default
    /// (`merge_kwargs`). A kwarg `chat_template` is refused unless requests' templates are
    /// trusted, and is no variable either way; nor is `continue_final_message`
    /// (transformers takes it as an argument). The request's tools go between the defaults
    /// and its kwargs (vLLM merges them into the defaults). vLLM always has defaults to
    /// merge into (its own `tokenize`, which no template sees), so a request's null or
    /// "auto" kwargs are always left out.
    fn kwargs(&self, vars: &Variables<'_>) -> Result<BTreeMap<String, Value>, RequestError> {
        let mut request = self.request_kwargs(vars)?;
        if let Some(effort) = self.options.effort(vars.reasoning_effort) {
            if !request.contains_key("enable_thinking") {
                request.insert("enable_thinking".into(), Value::from(effort != "none"));
            }
            request.insert("reasoning_effort".into(), Value::from(effort));
        }
        request.insert("add_generation_prompt".into(), Value::from(vars.add_generation_prompt));
        if let Some(documents) = vars.documents {
            request.insert("documents".into(), json_value(documents)?);
        }
        let mut merged = self.default_kwargs()?;
        if let Some(tools) = vars.tools {
            merged.insert("tools".into(), tools_value(tools)?);
        }
        let unset = |v: &Value| v.is_none() || v.as_str() == Some("auto");
        merged.extend(request.into_iter().filter(|(_, v)| !unset(v)));
        // Arguments of transformers' `apply_chat_template`, not variables, wherever they came
        // from.
        for argument in ["continue_final_message", "chat_template", "tokenize"] {
            merged.remove(argument);
        }
        Ok(merged)
    }

    /// The request's `chat_template_kwargs` as template values, without a `chat_template`
    /// (refused unless requests' templates are trusted; no variable either way).
    fn request_kwargs(&self, vars: &Variables<'_>) -> Result<BTreeMap<String, Value>, RequestError> {
        let mut request: BTreeMap<String, Value> = match vars.chat_template_kwargs {
            Some(kwargs) => {
                serde_json::from_str(kwargs.get()).map_err(|e| RequestError::Template(json_error(e)))?
            }
            None => BTreeMap::new(),
        };
        if let Some(template) = request.remove("chat_template")
            && !template.is_none()
            && !self.options.trust_request_chat_template
        {
            return Err(RequestError::UntrustedChatTemplate);
        }
        Ok(request)
    }

    /// The fleet's default kwargs (`--default-chat-template-kwargs`), as template values.
    fn default_kwargs(&self) -> Result<BTreeMap<String, Value>, RequestError> {
        let mut kwargs = BTreeMap::new();
        for (key, value) in self.options.default_chat_template_kwargs.iter().flatten() {
            let value = Value::deserialize(value).map_err(|e| RequestError::Template(json_error(e)))?;
            kwargs.insert(key.clone(), value);
        }
        Ok(kwargs)
    }

    /// The template a request brought (`chat_template`), compiled once and kept, with this
    /// one's special tokens and options (a template requests brought renders no other).
    fn requested(&self, source: &str) -> Result<Arc<ChatTemplate>, RequestError> {
        let Some(requested) = &self.requested else {
            return Err(RequestError::UntrustedChatTemplate);
        };
        requested.get_or_insert_with(source, || {
            let mut template = ChatTemplate::new(source, self.special.clone()).map_err(|e| match e {
                LoadError::Template(e) => RequestError::Template(e),
                other => RequestError::Template(Error::new(ErrorKind::SyntaxError, other.to_string())),
            })?;
            template.options = Arc::clone(&self.options);
            template.sglang = self.sglang;
            template.requested = None;
            template.env.set_fuel(Some(REQUESTED_TEMPLATE_FUEL));
            template.apply_options();
            Ok(Arc::new(template))
        })
    }
}

impl Facts {
    /// Compiles `source` into `env` as `name`.
    fn add(env: &mut Environment<'static>, name: &'static str, source: String) -> Result<Self, LoadError> {
        let source = match generation_tag::as_plain_blocks(&source) {
            Cow::Owned(plain) => plain,
            Cow::Borrowed(_) => source,
        };
        let facts = Facts {
            name,
            format: ContentFormat::of_template(&source),
            mentions_content: source.contains("content"),
            knows_developer: source.contains("\"developer\"") || source.contains("'developer'"),
            harmony: source.contains("<|channel|>") && source.contains("<|start|>"),
        };
        env.add_template_owned(name, source).map_err(LoadError::Template)?;
        Ok(facts)
    }

    /// The messages as vLLM hands them to this template: for one that does not name the
    /// `developer` role, a conversation with developer turns has them as system turns, and
    /// then, if a system turn is not the first, every system turn merged into one first one
    /// (their non-empty texts joined with a blank line; only `role` and a string `content`).
    fn passed<'m, 'a>(&self, messages: &'m [Message<'a>], format: ContentFormat) -> Vec<Passed<'m, 'a>> {
        let as_is = |message| Passed { message: Cow::Borrowed(message), plain: false };
        if self.knows_developer || !messages.iter().any(|m| m.role == "developer") {
            return messages.iter().map(as_is).collect();
        }
        let system = |m: &Message<'_>| m.role == "system" || m.role == "developer";
        if !messages.iter().skip(1).any(system) {
            let converted = messages.iter().map(|m| match m.role == "developer" {
                true => Passed {
                    message: Cow::Owned(Message { role: "system".into(), ..m.clone() }),
                    plain: false,
                },
                false => as_is(m),
            });
            return converted.collect();
        }
        let texts: Vec<Cow<'_, str>> = messages
            .iter()
            .filter(|m| system(m))
            .map(|m| match format {
                ContentFormat::String => Cow::Borrowed(m.content.as_deref().unwrap_or_default()),
                ContentFormat::OpenAi => all_parts_joined(m),
            })
            .filter(|text| !text.is_empty())
            .collect();
        let merged = Message {
            role: "system".into(),
            content: Some(Cow::Owned(texts.join("\n\n"))),
            media: None,
            extra: Vec::new(),
            parts: None,
        };
        std::iter::once(Passed { message: Cow::Owned(merged), plain: true })
            .chain(messages.iter().filter(|m| !system(m)).map(as_is))
            .collect()
    }

    /// The last message with [`CONTINUE_TAG`] after the text a continued prompt ends in (the
    /// last text part, in the "openai" content format), and that text, as transformers tags
    /// it.
    fn tagged<'m>(
        &self,
        last: &Message<'m>,
        format: ContentFormat,
    ) -> Result<(Message<'m>, String), RequestError> {
        if !self.mentions_content {
            return Err(RequestError::CannotContinue(
                "continue_final_message is set but the chat template has no 'content' to continue",
            ));
        }
        let mut last = last.clone();
        let text = match (format, &mut last.parts, &mut last.content) {
            // The last part with text, as transformers finds it.
            (ContentFormat::OpenAi, Some(parts), _) => parts.iter_mut().rev().find_map(|p| match p {
                Part::Text(text) | Part::Aside(text) => Some(text),
                Part::ToolReference(_) => None,
            }),
            (ContentFormat::OpenAi, None, content) => content.as_mut(),
            // A string content: `""` when the client sent none.
            (ContentFormat::String, _, content) => Some(content.get_or_insert_default()),
        }
        .ok_or(RequestError::CannotContinue(
            "continue_final_message is set but we could not find any text to continue in the final message",
        ))?;
        let original = text.to_string();
        text.to_mut().push_str(CONTINUE_TAG);
        Ok((last, original))
    }
}

/// A message as it goes to the template ([`Facts::passed`]).
struct Passed<'m, 'a> {
    message: Cow<'m, Message<'a>>,
    /// Its content is a string whatever the template's content format (a merged system turn).
    plain: bool,
}

impl Passed<'_, '_> {
    fn format(&self, template: ContentFormat) -> ContentFormat {
        if self.plain { ContentFormat::String } else { template }
    }
}

/// A message's text parts joined with newlines, empty ones too, as vLLM joins an
/// "openai"-format content's texts where it wants a string (a string content is one part;
/// tool references are no text).
fn all_parts_joined<'m>(message: &'m Message<'_>) -> Cow<'m, str> {
    match (&message.parts, &message.content) {
        (Some(parts), _) => Cow::Owned(texts_joined(parts, "\n")),
        (None, Some(text)) => Cow::Borrowed(text),
        (None, None) => Cow::Borrowed(""),
    }
}

/// What transformers appends to the text a continued prompt ends in, to find where that
/// text ends once rendered.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// A prompt rendered with [`CONTINUE_TAG`] after `text`, cut where the tag begins (and, when
/// the template trimmed the tag's space, cut of the whitespace before it too), as
/// transformers cuts it; an error when the template does not render `text` or the tag.
fn continued(mut rendered: String, text: &str) -> Result<String, RequestError> {
    let tag = CONTINUE_TAG.trim_end();
    let at = match rendered.rfind(tag) {
        Some(at) if rendered.contains(text.trim_matches(is_python_space)) => at,
        _ => {
            return Err(RequestError::CannotContinue(
                "continue_final_message is set but the final message does not appear in the chat after \
                 applying the chat template",
            ));
        }
    };
    let spaced = rendered[at..].starts_with(CONTINUE_TAG);
    rendered.truncate(at);
    if !spaced {
        rendered.truncate(rendered.trim_end_matches(is_python_space).len());
    }
    Ok(rendered)
}

/// Python's `str.isspace`: Unicode's white space and the four ASCII separators.
fn is_python_space(c: char) -> bool {
    c.is_whitespace() || ('\x1c'..='\x1f').contains(&c)
}

/// What a request sets of a template's variables besides `messages` (see the module docs).
#[derive(Clone, Copy, Debug, Default)]
pub struct Variables<'a> {
    pub add_generation_prompt: bool,
    /// End the prompt inside the last message's text, as transformers does.
    pub continue_final_message: bool,
    /// The request's `tools`, an array.
    pub tools: Option<&'a RawValue>,
    /// The request's `documents`, an array.
    pub documents: Option<&'a RawValue>,
    /// The request's `chat_template_kwargs`, an object.
    pub chat_template_kwargs: Option<&'a RawValue>,
    /// The request's `reasoning_effort`.
    pub reasoning_effort: Option<&'a str>,
    /// Whether the request's `tool_choice` is "none".
    pub tool_choice_none: bool,
    /// The request's own template (`chat_template`).
    pub chat_template: Option<&'a str>,
    /// The messages are the conversation's beginning, rendered for the tokens they share with
    /// the whole: no generation prompt, nothing continued, their last turn as it is (whatever
    /// the engine does at a conversation's end).
    pub beginning: bool,
}

/// Whether `raw` is `[]` (spaces aside).
fn is_empty_list(raw: &RawValue) -> bool {
    raw.get()
        .strip_prefix('[')
        .and_then(|rest| rest.strip_suffix(']'))
        .is_some_and(|inside| inside.trim().is_empty())
}

/// The text parts of `parts` (empty ones too; tool references are no text) joined with
/// `separator`.
fn texts_joined(parts: &[Part<'_>], separator: &str) -> String {
    let texts: Vec<&str> = parts
        .iter()
        .filter_map(|p| match p {
            Part::Text(text) | Part::Aside(text) => Some(text.as_ref()),
            Part::ToolReference(_) => None,
        })
        .collect();
    texts.join(separator)
}

fn read(path: &Path) -> Result<Vec<u8>, LoadError> {
    std::fs::read(path).map_err(|source| LoadError::Io { path: path.into(), source })
}

fn json_error(e: serde_json::Error) -> Error {
    Error::new(ErrorKind::CannotDeserialize, e.to_string())
}

/// The template in a request's `chat_template_kwargs`: none when absent, null, empty or
/// `"auto"`; anything but a string is an error.
fn kwargs_template(kwargs: Option<&RawValue>) -> Result<Option<String>, RequestError> {
    #[derive(Deserialize)]
    struct Kwargs {
        chat_template: Option<serde_json::Value>,
    }
    let Some(kwargs) = kwargs else { return Ok(None) };
    let kwargs: Kwargs =
        serde_json::from_str(kwargs.get()).map_err(|e| RequestError::Template(json_error(e)))?;
    match kwargs.chat_template {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) if s.is_empty() || s == "auto" => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(RequestError::Template(Error::new(
            ErrorKind::InvalidOperation,
            "chat_template_kwargs.chat_template must be a string",
        ))),
    }
}

/// A JSON value from the request as a template value (object key order kept).
fn json_value(raw: &RawValue) -> Result<Value, RequestError> {
    serde_json::from_str(raw.get()).map_err(|e| RequestError::Template(json_error(e)))
}

/// A message as the template sees it (see the module docs): `role`, `content`, then the
/// keys vLLM keeps, in its order; with `media_parts`, the content of a message with media is
/// a list of parts ([`ChatTemplate::render_with_media`]); in the "openai" content `format`,
/// every content is a list of parts.
fn message_value(
    message: &Message<'_>,
    media_parts: bool,
    format: ContentFormat,
) -> Result<Value, RequestError> {
    let role = message.role.as_ref();
    // The client's value of `key` (the last, as Python's `json` keeps), null included.
    let raw = |key: &str| message.extra.iter().rev().find(|(k, _)| k == key).map(|(_, raw)| *raw);
    let not_null = |r: &&RawValue| r.get() != "null";
    // In vLLM's order: tool calls, reasoning (under both its names), tool call id, name.
    let mut extra = Vec::new();
    if role == "assistant" {
        if let Some(calls) = raw("tool_calls").filter(not_null).map(tool_calls).transpose()?.flatten() {
            extra.push(("tool_calls", calls));
        }
        // vLLM reads `reasoning` (else the older `reasoning_content`, which it renames) and
        // passes it under both names.
        if let Some(reasoning) =
            raw("reasoning").filter(not_null).or_else(|| raw("reasoning_content").filter(not_null))
        {
            let reasoning = json_value(reasoning)?;
            extra.push(("reasoning", reasoning.clone()));
            extra.push(("reasoning_content", reasoning));
        }
    }
    if role == "tool"
        && let Some(id) = raw("tool_call_id")
    {
        extra.push(("tool_call_id", json_value(id)?));
    }
    if let Some(name) = raw("name").filter(|r| r.get().starts_with('"')) {
        extra.push(("name", json_value(name)?));
    }
    if let Some(task) = raw("task").filter(|r| r.get().starts_with('"')) {
        extra.push(("task", json_value(task)?));
    }
    // A developer turn (for a template that takes them) carries its `tools`, null if none.
    if role == "developer" {
        extra.push(("tools", raw("tools").map(json_value).transpose()?.unwrap_or(Value::from(()))));
    }
    /// A message's content as the template sees it.
    enum Content<'m> {
        Text(&'m str),
        /// A list: the media's modality first if any, then a part for each text or tool
        /// reference.
        Parts(Option<&'static str>, Vec<Item<'m>>),
    }
    /// A part of a list content, keys in vLLM's order (`type` first), which a template
    /// dumping them shows.
    #[derive(serde::Serialize)]
    #[serde(untagged)]
    enum Item<'p> {
        Media { r#type: &'p str },
        Part(Typed<'p>),
    }
    #[derive(serde::Serialize)]
    #[serde(tag = "type", rename_all = "snake_case")]
    enum Typed<'p> {
        Text { text: &'p str },
        ToolReference { name: Option<&'p str> },
    }
    fn item<'p>(part: &'p Part<'_>) -> Item<'p> {
        match part {
            Part::Text(text) | Part::Aside(text) => Item::Part(Typed::Text { text }),
            Part::ToolReference(name) => Item::Part(Typed::ToolReference { name: name.as_deref() }),
        }
    }
    fn text_item(text: &str) -> Item<'_> {
        Item::Part(Typed::Text { text })
    }
    struct View<'m> {
        role: &'m str,
        content: Content<'m>,
        extra: Vec<(&'m str, Value)>,
    }
    impl serde::Serialize for View<'_> {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            let mut map = s.serialize_map(Some(2 + self.extra.len()))?;
            map.serialize_entry("role", self.role)?;
            match &self.content {
                Content::Text(text) => map.serialize_entry("content", text)?,
                Content::Parts(media, parts) => {
                    let media = media.map(|modality| Item::Media { r#type: modality });
                    let items: Vec<&Item<'_>> = media.iter().chain(parts).collect();
                    map.serialize_entry("content", &items)?
                }
            }
            for (k, v) in &self.extra {
                map.serialize_entry(k, v)?;
            }
            map.end()
        }
    }
    let media = message.media.as_deref().filter(|_| media_parts).map(modality);
    let text = message.content.as_deref().unwrap_or_default();
    // vLLM's "openai" format: a list's text parts (empty ones too), a string as one part, no
    // content as none.
    let joined;
    let content = match (format, media) {
        // vLLM makes a tool turn's text parts one string, for templates that only take one,
        // unless it has other parts (tool references, for the template to expand).
        (ContentFormat::OpenAi, None)
            if role == "tool"
                && message.media.is_none()
                && !message.parts.iter().flatten().any(|p| matches!(p, Part::ToolReference(_))) =>
        {
            joined = all_parts_joined(message);
            Content::Text(&joined)
        }
        (ContentFormat::OpenAi, _) => match (&message.parts, &message.content) {
            (Some(parts), _) => Content::Parts(media, parts.iter().map(item).collect()),
            (None, Some(text)) => Content::Parts(media, vec![text_item(text)]),
            (None, None) => Content::Parts(media, Vec::new()),
        },
        (ContentFormat::String, Some(_)) => Content::Parts(media, vec![text_item(text)]),
        (ContentFormat::String, None) => Content::Text(text),
    };
    let view = View { role, content, extra };
    Ok(Value::from(minijinja::value::Serde(view)))
}

/// The request's `tools` as vLLM hands them to the template (each its pydantic model dumped):
/// a tool whose `function` is an object becomes `{"type": "function", "function": {"name",
/// "description", "parameters", "strict", "defer_loading"}}` in that order, `description` and
/// `parameters` null when absent, `strict` and `defer_loading` (the function's own, else the
/// tool's) only when set, then the tool's own `defer_loading` when set, and no other key;
/// anything else is passed as it is.
fn tools_value(raw: &RawValue) -> Result<Value, RequestError> {
    #[derive(serde::Serialize)]
    struct Function<'a> {
        name: Option<&'a RawValue>,
        description: Option<&'a RawValue>,
        parameters: Option<&'a RawValue>,
        #[serde(skip_serializing_if = "Option::is_none")]
        strict: Option<Flag<'a>>,
        #[serde(skip_serializing_if = "Option::is_none")]
        defer_loading: Option<Flag<'a>>,
    }
    #[derive(serde::Serialize)]
    struct Dumped<'a> {
        #[serde(rename = "type")]
        kind: &'static str,
        function: Function<'a>,
        #[serde(skip_serializing_if = "Option::is_none")]
        defer_loading: Option<Flag<'a>>,
    }
    dump_tools(raw, |tool, function| Dumped {
        kind: "function",
        function: Function {
            name: function.name,
            description: function.description,
            parameters: function.parameters,
            strict: function.strict,
            // The function's own, else the tool's; the tool keeps its own too.
            defer_loading: function.defer_loading.or(tool.defer_loading),
        },
        defer_loading: tool.defer_loading,
    })
}

/// A request's tool, the fields an engine's model of it reads (a null one reads as absent).
#[derive(Deserialize)]
struct ToolIn<'a> {
    #[serde(borrow, rename = "type")]
    kind: Option<&'a RawValue>,
    #[serde(borrow)]
    function: Option<&'a RawValue>,
    #[serde(borrow)]
    defer_loading: Option<Flag<'a>>,
}

/// A tool's `function`, as [`ToolIn`] is read.
#[derive(Deserialize)]
struct FunctionIn<'a> {
    #[serde(borrow)]
    name: Option<&'a RawValue>,
    #[serde(borrow)]
    description: Option<&'a RawValue>,
    #[serde(borrow)]
    parameters: Option<&'a RawValue>,
    #[serde(borrow)]
    strict: Option<Flag<'a>>,
    #[serde(borrow)]
    defer_loading: Option<Flag<'a>>,
}

/// The tools of `raw`, each whose `function` is an object as `dumped` makes it of the tool
/// and its function, any other as it is (and `raw` as it is when it is no list).
fn dump_tools<'a, D: serde::Serialize>(
    raw: &'a RawValue,
    dumped: impl Fn(&ToolIn<'a>, FunctionIn<'a>) -> D,
) -> Result<Value, RequestError> {
    let Ok(items) = serde_json::from_str::<Vec<&RawValue>>(raw.get()) else { return json_value(raw) };
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        let tool = serde_json::from_str::<ToolIn<'_>>(item.get()).ok();
        let function = tool.as_ref().and_then(|t| t.function).filter(|f| f.get().starts_with('{'));
        let Some((tool, function)) =
            tool.zip(function.and_then(|f| serde_json::from_str::<FunctionIn<'_>>(f.get()).ok()))
        else {
            out.push(json_value(item)?);
            continue;
        };
        let dumped = serde_json::value::to_raw_value(&dumped(&tool, function))
            .map_err(|e| RequestError::Template(json_error(e)))?;
        out.push(json_value(&dumped)?);
    }
    Ok(Value::from(out))
}

/// A tool's `bool | None` field (`strict`, `defer_loading`) as pydantic's lax mode reads it
/// (`"true"`, `1`, `"yes"`, ...) and vLLM dumps it, a boolean; kept as it came when it is
/// not one (vLLM then refuses the request, and the replica says so).
#[derive(Clone, Copy, serde::Serialize)]
#[serde(untagged)]
enum Flag<'a> {
    Bool(bool),
    Raw(&'a RawValue),
}

impl<'de: 'a, 'a> Deserialize<'de> for Flag<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = <&'de RawValue>::deserialize(d)?;
        Ok(match super::request::lax_boolean(raw) {
            Some(b) => Flag::Bool(b),
            None => Flag::Raw(raw),
        })
    }
}

/// The modality vLLM gives a media part of type `part_type` (an unknown type: `"image"`).
fn modality(part_type: &str) -> &'static str {
    match part_type {
        "audio_url" | "input_audio" | "audio_embeds" => "audio",
        "video_url" => "video",
        _ => "image",
    }
}

/// An assistant's `tool_calls` as vLLM hands them to the template: none when empty; else
/// each call with its `function.arguments` a JSON value, parsed from the string the OpenAI
/// API sends, as transformers' templates expect.
fn tool_calls(raw: &RawValue) -> Result<Option<Value>, RequestError> {
    let calls = json_value(raw)?;
    let Ok(items) = calls.try_iter() else { return Ok((!calls.is_none()).then_some(calls)) };
    let items: Vec<Value> = items.collect();
    if items.is_empty() {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(items.len());
    for call in items {
        let Some(function) = call.get_attr("function").ok().filter(|f| f.kind() == ValueKind::Map) else {
            out.push(call);
            continue;
        };
        // A JSON string is parsed; an object kept; anything that is not an object then (null,
        // "", text that is not JSON, a number, an array) is `{}`, as vLLM does.
        let arguments = function.get_attr("arguments").unwrap_or_default();
        let arguments = match arguments.as_str() {
            Some(text) => match serde_json::from_str::<&RawValue>(text) {
                Ok(raw) => json_value(raw)?,
                Err(_) => Value::UNDEFINED,
            },
            None => arguments,
        };
        let arguments = match arguments.kind() {
            ValueKind::Map => arguments,
            _ => Value::from(BTreeMap::<String, Value>::new()),
        };
        // vLLM validates each call against OpenAI's typed dicts, which writes their fields in
        // the types' order (what a template that dumps them shows), the others after.
        let function = reordered(&replace(&function, "arguments", arguments), &["arguments", "name"]);
        out.push(reordered(&replace(&call, "function", function), &["id", "function", "type"]));
    }
    Ok(Some(Value::from(out)))
}

/// `map` with the `first` keys it has first, in that order, and the rest after in theirs.
fn reordered(map: &Value, first: &[&str]) -> Value {
    let keys: Vec<Value> = map.try_iter().into_iter().flatten().collect();
    let rank = |k: &Value| k.as_str().and_then(|k| first.iter().position(|f| *f == k)).unwrap_or(first.len());
    let mut keys: Vec<(usize, Value)> = keys.into_iter().map(|k| (rank(&k), k)).collect();
    keys.sort_by_key(|(rank, _)| *rank);
    let pairs = keys.into_iter().map(|(_, k)| {
        let v = map.get_item(&k).unwrap_or_default();
        (k, v)
    });
    ordered_map(pairs.collect())
}

/// `map` with `key`'s value replaced by (or `key` added with) `value`, key order kept.
fn replace(map: &Value, key: &str, value: Value) -> Value {
    let mut value = Some(value);
    let mut pairs: Vec<(Value, Value)> = map
        .try_iter()
        .into_iter()
        .flatten()
        .map(|k| {
            let v = if k.as_str() == Some(key) {
                value.take().unwrap_or_default()
            } else {
                map.get_item(&k).unwrap_or_default()
            };
            (k, v)
        })
        .collect();
    if let Some(value) = value {
        pairs.push((Value::from(key), value));
    }
    ordered_map(pairs)
}

/// A map of `pairs`, in their order.
fn ordered_map(pairs: Vec<(Value, Value)>) -> Value {
    struct Ordered(Vec<(Value, Value)>);
    impl serde::Serialize for Ordered {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            let mut map = s.serialize_map(Some(self.0.len()))?;
            for (k, v) in &self.0 {
                map.serialize_entry(k, v)?;
            }
            map.end()
        }
    }
    Value::from(minijinja::value::Serde(Ordered(pairs)))
}

/// `raise_exception(message)`: HF templates' way of rejecting a conversation.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// Today's date, `YYYY-MM-DD`, in local time ([`strftime_now`]).
pub fn today() -> String {
    strftime_now("%Y-%m-%d".into())
}

/// `strftime_now(format)`: the current local time, as transformers' `datetime.now()` gives
/// it (the `TZ` variable, else the system's zone; UTC when neither can be read): the router
/// must run in the replicas' time zone. Supports `%Y %m %d %e %b %B %a %A %H %M %S %y %j %%`
/// (and `%-d`, `%-m`); other directives are copied as they are.
fn strftime_now(format: String) -> String {
    strftime(&format, local_secs(jiff::Timestamp::now(), local_zone()))
}

/// The process's time zone, read once (`TZ`, else the system's; UTC when neither can be
/// read): a lookup that fails is not cached by jiff, and would be tried at every render.
pub fn local_zone() -> &'static jiff::tz::TimeZone {
    static ZONE: std::sync::OnceLock<jiff::tz::TimeZone> = std::sync::OnceLock::new();
    ZONE.get_or_init(jiff::tz::TimeZone::system)
}

/// The wall-clock time in `zone` at `at`, as seconds since 1970-01-01 00:00 of that clock.
fn local_secs(at: jiff::Timestamp, zone: &jiff::tz::TimeZone) -> u64 {
    let offset = i64::from(zone.to_offset(at).seconds());
    u64::try_from(at.as_second().saturating_add(offset)).unwrap_or(0)
}

fn strftime(format: &str, unix_secs: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = unix_secs / 86_400;
    let secs = unix_secs % 86_400;
    // Howard Hinnant's civil_from_days, for days since 1970-01-01 (non-negative here).
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    let leap = (year.is_multiple_of(4) && !year.is_multiple_of(100)) || year.is_multiple_of(400);
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cumulative[(month - 1) as usize] + day + u64::from(leap && month > 2);
    let weekday = ((days + 3) % 7) as usize; // 1970-01-01 was a Thursday.
    let month_name = MONTHS[(month - 1) as usize];

    let mut out = String::with_capacity(format.len() + 8);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let (unpadded, d) = match chars.next() {
            Some('-') => (true, chars.next()),
            d => (false, d),
        };
        let num = |n: u64, width: usize| if unpadded { n.to_string() } else { format!("{n:0width$}") };
        match d {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&num(year % 100, 2)),
            Some('m') => out.push_str(&num(month, 2)),
            Some('d') => out.push_str(&num(day, 2)),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('j') => out.push_str(&num(yday, 3)),
            Some('H') => out.push_str(&num(secs / 3600, 2)),
            Some('M') => out.push_str(&num(secs / 60 % 60, 2)),
            Some('S') => out.push_str(&num(secs % 60, 2)),
            Some('b') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Writes `{{ value }}` as Jinja2 does: minijinja's way, but floats as Python spells them,
/// in a list or a dict too.
fn write_value(
    out: &mut minijinja::Output,
    state: &mut minijinja::State,
    value: &Value,
) -> Result<(), Error> {
    match python_str(value) {
        Some(text) => out.write_str(&text).map_err(Error::from),
        None => minijinja::escape_formatter(out, state, value),
    }
}

/// The `string` filter as Jinja2's (`str(value)`): minijinja's, but floats as Python spells
/// them (Qwen3-Coder writes a tool call's scalar arguments with it), in a list or a dict too.
fn string(state: &minijinja::State, value: &Value) -> Result<Value, Error> {
    match python_str(value) {
        Some(text) => Ok(Value::from(text)),
        None => minijinja::filters::string(state, value),
    }
}

/// `str(value)` as Python writes it where minijinja writes it otherwise: a float, and a list
/// or dict that holds one (minijinja writes a float in one as Rust does: `1e-5` for
/// Python's `1e-05`; vLLM hands templates a tool call's arguments as a dict). `None` where
/// minijinja's is Python's.
fn python_str(value: &Value) -> Option<String> {
    if let Some(x) = f64_of(value) {
        return Some(python_float::python_float(x));
    }
    holds_float(value, 0).then(|| {
        let mut out = String::new();
        python_repr(value, &mut out);
        out
    })
}

/// `value`'s items (a map's keys), each written by `each`, between `brackets` and apart by
/// `", "`.
fn bracketed(
    value: &Value,
    brackets: (char, char),
    out: &mut String,
    mut each: impl FnMut(&Value, &mut String),
) {
    out.push(brackets.0);
    for (i, item) in value.try_iter().into_iter().flatten().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        each(&item, out);
    }
    out.push(brackets.1);
}

/// How deep [`holds_float`] looks (a template's values come from JSON, nested not much).
const REPR_DEPTH: usize = 32;

/// Whether `value` is a plain list or dict with a float in it, at any depth.
fn holds_float(value: &Value, depth: usize) -> bool {
    if depth > REPR_DEPTH {
        return false;
    }
    match value.kind() {
        ValueKind::Number => f64_of(value).is_some(),
        ValueKind::Seq => value.try_iter().is_ok_and(|mut items| items.any(|v| holds_float(&v, depth + 1))),
        ValueKind::Map if value.as_object().is_none_or(|o| o.repr() == minijinja::value::ObjectRepr::Map) => {
            value.try_iter().is_ok_and(|mut keys| {
                keys.any(|k| value.get_item(&k).is_ok_and(|v| holds_float(&v, depth + 1)))
            })
        }
        _ => false,
    }
}

/// Python's `repr` of a list, a dict or a scalar in one (minijinja's, whose strings are
/// Python's, but for floats).
fn python_repr(value: &Value, out: &mut String) {
    use std::fmt::Write as _;
    match (value.kind(), f64_of(value)) {
        (_, Some(x)) => out.push_str(&python_float::python_float(x)),
        (ValueKind::Seq, _) => bracketed(value, ('[', ']'), out, python_repr),
        (ValueKind::Map, _) => bracketed(value, ('{', '}'), out, |key, out| {
            python_repr(key, out);
            out.push_str(": ");
            python_repr(&value.get_item(key).unwrap_or_default(), out);
        }),
        _ => {
            let _ = write!(out, "{value:?}");
        }
    }
}

/// The float `value` holds, if it is one (not an integer).
fn f64_of(value: &Value) -> Option<f64> {
    if value.kind() != ValueKind::Number || value.is_integer() {
        return None;
    }
    f64::try_from(value.clone()).ok()
}

/// The widest `tojson` indent, in spaces or bytes of the string given.
const MAX_TOJSON_INDENT: usize = 64;

/// `tojson(ensure_ascii=False, indent=None, separators=None, sort_keys=False)`: Python's
/// `json.dumps` with those arguments, as transformers defines the filter (Kimi's templates
/// write their tools with `separators=(',', ':')`).
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    let indent = match indent.filter(|i| !i.is_none()) {
        None => None,
        Some(i) => match (i.as_str(), i.as_usize()) {
            (Some(text), _) if text.len() <= MAX_TOJSON_INDENT => Some(text.as_bytes().to_vec()),
            (None, Some(n)) if n <= MAX_TOJSON_INDENT => Some(vec![b' '; n]),
            (Some(_), _) | (None, Some(_)) => {
                // Written at every level of the value: a huge one is memory, not layout.
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: an indent over {MAX_TOJSON_INDENT} is not supported"),
                ));
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be a number or a string",
                ));
            }
        },
    };
    // Python's defaults: `", "` between items, or `","` when indenting; `": "` after keys.
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone().into_bytes(), key.clone().into_bytes()),
        Some(_) => {
            return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators must be two strings"));
        }
        None if indent.is_some() => (b",".to_vec(), b": ".to_vec()),
        None => (b", ".to_vec(), b": ".to_vec()),
    };
    let sorted;
    let value = if sort_keys {
        sorted = sorted_keys(value);
        &sorted
    } else {
        value
    };
    let mut out = Vec::new();
    let formatter = PythonFormatter { item, key, indent, ensure_ascii, level: 0, has_value: false };
    let mut ser = serde_json::Serializer::with_formatter(&mut out, formatter);
    serde::Serialize::serialize(value, &mut ser)
        .map_err(|e| Error::new(ErrorKind::BadSerialization, e.to_string()))?;
    Ok(Value::from(String::from_utf8_lossy(&out).into_owned()))
}

/// `value` with every map's keys sorted (Python's `sort_keys=True`).
fn sorted_keys(value: &Value) -> Value {
    match value.kind() {
        ValueKind::Map => {
            let mut pairs: Vec<(Value, Value)> = value
                .try_iter()
                .into_iter()
                .flatten()
                .map(|k| {
                    let v = sorted_keys(&value.get_item(&k).unwrap_or_default());
                    (k, v)
                })
                .collect();
            pairs.sort_by_key(|(k, _)| k.to_string());
            ordered_map(pairs)
        }
        ValueKind::Seq => {
            Value::from(value.try_iter().into_iter().flatten().map(|v| sorted_keys(&v)).collect::<Vec<_>>())
        }
        _ => value.clone(),
    }
}

/// `json.dumps(value)` with Python's defaults: `", "` and `": "` between items and after keys,
/// every non-ASCII character (and DEL) as `\uXXXX`.
pub(crate) fn python_json_dumps(value: &serde_json::Value) -> String {
    let formatter = PythonFormatter {
        item: b", ".to_vec(),
        key: b": ".to_vec(),
        indent: None,
        ensure_ascii: true,
        level: 0,
        has_value: false,
    };
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, formatter);
    // Writing to memory cannot fail, and what is written is ASCII.
    let _ = serde::Serialize::serialize(value, &mut ser);
    String::from_utf8_lossy(&out).into_owned()
}

/// serde_json output as Python's `json.dumps` writes it: its item and key separators, its
/// indentation (a newline and the indent for each level after `[`, `{` and each item
/// separator), and with `ensure_ascii` every non-ASCII character (and DEL) as `\uXXXX`.
struct PythonFormatter {
    item: Vec<u8>,
    key: Vec<u8>,
    indent: Option<Vec<u8>>,
    ensure_ascii: bool,
    level: usize,
    has_value: bool,
}

impl PythonFormatter {
    fn newline<W: ?Sized + std::io::Write>(&self, w: &mut W) -> std::io::Result<()> {
        if let Some(indent) = &self.indent {
            w.write_all(b"\n")?;
            for _ in 0..self.level {
                w.write_all(indent)?;
            }
        }
        Ok(())
    }

    fn open<W: ?Sized + std::io::Write>(&mut self, w: &mut W, bracket: &[u8]) -> std::io::Result<()> {
        self.level += 1;
        self.has_value = false;
        w.write_all(bracket)
    }

    fn close<W: ?Sized + std::io::Write>(&mut self, w: &mut W, bracket: &[u8]) -> std::io::Result<()> {
        self.level -= 1;
        if self.has_value {
            self.newline(w)?;
        }
        w.write_all(bracket)
    }

    fn item<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if !first {
            w.write_all(&self.item)?;
        }
        self.newline(w)
    }
}

impl serde_json::ser::Formatter for PythonFormatter {
    fn write_f64<W: ?Sized + std::io::Write>(&mut self, w: &mut W, value: f64) -> std::io::Result<()> {
        w.write_all(python_float::python_float(value).as_bytes())
    }
    fn begin_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"[")
    }
    fn end_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"]")
    }
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.item(w, first)
    }
    fn end_array_value<W: ?Sized + std::io::Write>(&mut self, _: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }
    fn begin_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"{")
    }
    fn end_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"}")
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.item(w, first)
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(&self.key)
    }
    fn end_object_value<W: ?Sized + std::io::Write>(&mut self, _: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }
    fn write_string_fragment<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        fragment: &str,
    ) -> std::io::Result<()> {
        // Python writes DEL escaped too: only ' ' to '~' go as they are (control characters
        // below ' ' never reach a fragment).
        if !self.ensure_ascii || (fragment.is_ascii() && !fragment.contains('\x7f')) {
            return w.write_all(fragment.as_bytes());
        }
        for c in fragment.chars() {
            if c.is_ascii() && c != '\x7f' {
                w.write_all(&[c as u8])?;
            } else {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    write!(w, "\\u{unit:04x}")?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_known_dates() {
        // 2024-02-29T13:05:09Z, a Thursday; day 60 of a leap year.
        let t = 1_709_211_909;
        assert_eq!(strftime("%d %b %Y", t), "29 Feb 2024");
        assert_eq!(
            strftime("%A %B %-d, %y %H:%M:%S %j %% %Q", t),
            "Thursday February 29, 24 13:05:09 060 % %Q"
        );
        assert_eq!(strftime("%Y-%m-%d %a", 0), "1970-01-01 Thu");
        assert_eq!(strftime("%Y-%m-%d", 1_798_675_200), "2026-12-31");
    }

    /// The date a template prints is the local one, as transformers' `datetime.now()`: five
    /// hours west of UTC, 2024-02-29T03:00Z is still the 28th.
    #[test]
    fn strftime_now_is_in_local_time() {
        let at = jiff::Timestamp::from_second(1_709_175_600).unwrap();
        let new_york = jiff::tz::TimeZone::posix("EST5").unwrap();
        assert_eq!(strftime("%Y-%m-%d %H:%M", local_secs(at, &new_york)), "2024-02-28 22:00");
        assert_eq!(strftime("%Y-%m-%d %H:%M", local_secs(at, &jiff::tz::TimeZone::UTC)), "2024-02-29 03:00");
    }

    /// A template with transformers' `{% generation %}` blocks (LFM2's, TRL's assistant-only
    /// training templates) renders as the same template without them, as in vLLM.
    #[test]
    fn generation_blocks_render_their_body() {
        let body = "{%- for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}TAG{{ m.content }}END\
                    {% else %}{{ m.content }}{% endif %}\n{% endfor -%}";
        let chat = crate::openai::ChatRequest::parse(
            br#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":" there "}]}"#,
        )
        .unwrap();
        let render = |source: String| {
            let template = ChatTemplate::new(source, SpecialTokens::default()).unwrap();
            template.render(&chat.messages, Variables::default()).unwrap()
        };
        let tagged = render(body.replace("TAG", "{%- generation %}").replace("END", "{% endgeneration -%}"));
        assert_eq!(tagged, render(body.replace("TAG", "{%- if true %}").replace("END", "{% endif -%}")));
        assert_eq!(tagged, "<user>hi<assistant> there ");
    }

    /// Hugging Face's `chat_template.json` holds the template alone: its special tokens come
    /// from elsewhere (here `special`), not as empty strings; a tokenizer config's own win.
    #[test]
    fn a_chat_template_json_takes_the_special_tokens_it_does_not_name() {
        let dir = std::env::temp_dir().join(format!("kvroute-chat-template-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let special = SpecialTokens::new([("bos_token", "<B>"), ("eos_token", "<E>")]);
        let source = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}{{ eos_token }}";
        let chat =
            crate::openai::ChatRequest::parse(br#"{"messages":[{"role":"user","content":"hi"}]}"#).unwrap();
        let alone = dir.join("chat_template.json");
        std::fs::write(&alone, serde_json::json!({ "chat_template": source }).to_string()).unwrap();
        let template = ChatTemplate::from_file(&alone, special.clone()).unwrap();
        assert_eq!(template.render(&chat.messages, Variables::default()).unwrap(), "<B>hi<E>");
        let config = dir.join("tokenizer_config.json");
        std::fs::write(
            &config,
            serde_json::json!({ "chat_template": source, "bos_token": "<s>" }).to_string(),
        )
        .unwrap();
        let template = ChatTemplate::from_file(&config, special).unwrap();
        assert_eq!(template.render(&chat.messages, Variables::default()).unwrap(), "<s>hi<E>");
        // The other named special tokens the config sets, as transformers passes them; one it
        // does not set is not a variable.
        let others = "{{ pad_token }}|{{ unk_token }}|{{ sep_token is defined }}";
        let tokens = serde_json::json!({ "chat_template": others, "pad_token": "<pad>",
            "unk_token": {"content": "<unk>", "lstrip": false}, "sep_token": null });
        std::fs::write(&config, tokens.to_string()).unwrap();
        let template = ChatTemplate::from_file(&config, SpecialTokens::default()).unwrap();
        assert_eq!(template.render(&chat.messages, Variables::default()).unwrap(), "<pad>|<unk>|False");
        // An unset bos is no variable, as transformers leaves it (not ""); a model's own named
        // tokens are, an `extra_special_tokens` object's over its `*_token` keys; a flag
        // named `*_token` is not a token.
        let named = "{{ bos_token is defined }}|{{ bos_token | default('none') }}|{{ image_token }}|\
                     {{ video_token }}|{{ add_bos_token is defined }}";
        let tokens = serde_json::json!({ "chat_template": named, "bos_token": null, "add_bos_token": true,
            "image_token": "<img>", "video_token": "<v>", "extra_special_tokens": {"video_token": "<video>"} });
        std::fs::write(&config, tokens.to_string()).unwrap();
        let template = ChatTemplate::from_file(&config, SpecialTokens::new([("bos_token", "<B>")])).unwrap();
        assert_eq!(
            template.render(&chat.messages, Variables::default()).unwrap(),
            "False|none|<img>|<video>|False"
        );
        // An object is a token only as an AddedToken; `additional_special_tokens` stands in
        // for an absent `extra_special_tokens`.
        let typed = "{{ a_token }}|{{ b_token is defined }}|{{ c_token }}";
        let tokens = serde_json::json!({ "chat_template": typed,
            "a_token": {"__type": "AddedToken", "content": "<a>"}, "b_token": {"content": "<b>"},
            "extra_special_tokens": {}, "additional_special_tokens": {"c_token": "<c>"} });
        std::fs::write(&config, tokens.to_string()).unwrap();
        let template = ChatTemplate::from_file(&config, SpecialTokens::default()).unwrap();
        assert_eq!(template.render(&chat.messages, Variables::default()).unwrap(), "<a>|False|<c>");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Template files beside a tokenizer config win over its `chat_template`, as transformers
    /// 5.20 loads them: `chat_template.jinja`, and a `tool_use` one in
    /// `additional_chat_templates/`; the config's special tokens go with them.
    #[test]
    fn template_files_beside_the_tokenizer_config_win() {
        let dir = std::env::temp_dir().join(format!("kvroute-beside-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("additional_chat_templates")).unwrap();
        let config = dir.join("tokenizer_config.json");
        let inline = serde_json::json!({ "chat_template": "C{{ bos_token }}", "bos_token": "<s>" });
        std::fs::write(&config, inline.to_string()).unwrap();
        let chat =
            crate::openai::ChatRequest::parse(br#"{"messages":[{"role":"user","content":"hi"}]}"#).unwrap();
        let with_tools = crate::openai::ChatRequest::parse(
            br#"{"messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"f"}}]}"#,
        )
        .unwrap();
        let render = |chat: &crate::openai::ChatRequest<'_>| {
            ChatTemplate::from_tokenizer_config(&config)
                .unwrap()
                .render(&chat.messages, chat.variables())
                .unwrap()
        };
        assert_eq!(render(&chat), "C<s>", "the config's own, with no file beside it");
        std::fs::write(dir.join("chat_template.jinja"), "J{{ bos_token }}").unwrap();
        assert_eq!(render(&chat), "J<s>");
        assert_eq!(render(&with_tools), "J<s>");
        std::fs::write(dir.join("additional_chat_templates/tool_use.jinja"), "T{{ tools | length }}")
            .unwrap();
        assert_eq!(render(&with_tools), "T1");
        assert_eq!(render(&chat), "J<s>");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// gpt-oss's template (Harmony) is told apart from ChatML and Llama-style ones.
    #[test]
    fn a_harmony_template_is_recognised() {
        let harmony = "{{- '<|start|>system<|message|>' }}{% for m in messages %}\
            {{- '<|start|>' + m.role + '<|channel|>final<|message|>' + m.content + '<|end|>' }}{% endfor %}";
        assert!(ChatTemplate::new(harmony, SpecialTokens::default()).unwrap().is_harmony());
        assert!(!ChatTemplate::builtin_default().is_harmony());
        let llama = "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>{% endfor %}";
        assert!(!ChatTemplate::new(llama, SpecialTokens::default()).unwrap().is_harmony());
    }

    /// A model with named templates renders with `default`, and with `tool_use` when the
    /// request has tools (an empty list too), as transformers chooses.
    #[test]
    fn a_request_with_tools_renders_with_the_tool_use_template() {
        let dir = std::env::temp_dir().join(format!("kvroute-tool-use-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("tokenizer_config.json");
        let templates = serde_json::json!([
            {"name": "tool_use", "template": "{% for m in messages %}{% for p in m.content %}T[{{ p.text }}]{% endfor %}{% endfor %}{{ tools | length }}"},
            {"name": "default", "template": "D[{{ messages[0].content }}]"},
        ]);
        std::fs::write(&config, serde_json::json!({ "chat_template": templates }).to_string()).unwrap();
        let template = ChatTemplate::from_tokenizer_config(&config).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let render = |extra: &str| {
            let body = format!(r#"{{"messages":[{{"role":"user","content":"q"}}]{extra}}}"#);
            let chat = crate::openai::ChatRequest::parse(body.as_bytes()).unwrap();
            template.render(&chat.messages, chat.variables()).unwrap()
        };
        assert_eq!(render(""), "D[q]");
        // Each template's own content format: the tool_use one loops over the parts.
        assert_eq!(render(r#","tools":[{"type":"function","function":{"name":"f"}}]"#), "T[q]1");
        assert_eq!(render(r#","tools":[]"#), "T[q]0");
    }

    /// Messages reach the template as vLLM passes them: arguments parsed from their JSON
    /// string (`{}` for null, empty, not JSON or not an object), each call's keys in
    /// OpenAI's typed-dict order (`id`, `function` with `arguments` then `name`, `type`),
    /// empty or null `tool_calls` gone, content
    /// `""` for none, and only the keys vLLM keeps, in its order (an assistant's `tool_calls`
    /// and `reasoning`, also as `reasoning_content`, a tool's `tool_call_id`, a string `name`).
    #[test]
    fn messages_are_normalised_as_vllm_normalises_them() {
        let source = "{% for m in messages %}{{ m | tojson }}\n{% endfor %}";
        let template = ChatTemplate::new(source, SpecialTokens::default()).unwrap();
        let body = br#"{"model":"m","messages":[
            {"role":"user","content":"weather?","name":"ann","foo":1},
            {"role":"assistant","content":null,"reasoning":"look it up","tool_calls":[
                {"id":"c1","type":"function","function":{"name":"w","arguments":"{\"city\": \"Paris\", \"n\": [1, 2]}"}},
                {"id":"c2","type":"function","function":{"name":"x","arguments":""}},
                {"id":"c3","type":"function","function":{"name":"y","arguments":null}}]},
            {"role":"tool","content":"sunny","tool_call_id":"c1","name":7},
            {"role":"assistant","content":"done","tool_calls":[],"tool_call_id":"z"},
            {"role":"user","content":"ok","tool_calls":null}]}"#;
        let chat = crate::openai::ChatRequest::parse(body).unwrap();
        let out = template.render(&chat.messages, Variables::default()).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(
            lines,
            [
                r#"{"role": "user", "content": "weather?", "name": "ann"}"#,
                r#"{"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"arguments": {"city": "Paris", "n": [1, 2]}, "name": "w"}, "type": "function"}, {"id": "c2", "function": {"arguments": {}, "name": "x"}, "type": "function"}, {"id": "c3", "function": {"arguments": {}, "name": "y"}, "type": "function"}], "reasoning": "look it up", "reasoning_content": "look it up"}"#,
                r#"{"role": "tool", "content": "sunny", "tool_call_id": "c1"}"#,
                r#"{"role": "assistant", "content": "done"}"#,
                r#"{"role": "user", "content": "ok"}"#,
            ]
        );
        let odd = br#"{"model":"m","messages":[{"role":"assistant","reasoning":"r","reasoning_content":"ignored","tool_calls":[
            {"function":{"name":"w","arguments":"{not json"}},{"function":{"name":"v","arguments":5}},
            {"type":"function","x":1,"function":{"arguments":"[1, 2]","name":"u"},"id":"c4"}]},
            {"role":"tool","content":"x","tool_call_id":null},
            {"role":"assistant","content":"a","reasoning":null,"reasoning_content":"older name"}]}"#;
        let chat = crate::openai::ChatRequest::parse(odd).unwrap();
        let out = template.render(&chat.messages, Variables::default()).unwrap();
        assert_eq!(
            out.lines().collect::<Vec<_>>(),
            [
                r#"{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}, "name": "w"}}, {"function": {"arguments": {}, "name": "v"}}, {"id": "c4", "function": {"arguments": {}, "name": "u"}, "type": "function", "x": 1}], "reasoning": "r", "reasoning_content": "r"}"#,
                r#"{"role": "tool", "content": "x", "tool_call_id": null}"#,
                r#"{"role": "assistant", "content": "a", "reasoning": "older name", "reasoning_content": "older name"}"#,
            ]
        );
    }

    #[test]
    fn templates_see_tools_extra_keys_and_kwargs() {
        let source = "{% for m in messages %}{{ m.role }}:{{ m.content }}|{{ m.tool_calls | tojson }}\n{% endfor %}\
                      {{ tools | tojson }} {{ tools is none }} {{ documents is none }} {{ flag }} {{ bos_token }}";
        let special = SpecialTokens::new([("bos_token", "<s>"), ("eos_token", "</s>")]);
        let template = ChatTemplate::new(source, special).unwrap();
        let body = br#"{"model":"m","messages":[{"role":"assistant","content":null,
            "tool_calls":[{"id":"c1","function":{"name":"f","arguments":"{}"}}]}],
            "tools":[{"type":"function","function":{"name":"f"}}],"chat_template_kwargs":{"flag":"on","bos_token":"<B>"}}"#;
        let chat = crate::openai::ChatRequest::parse(body).unwrap();
        let out = template.render(&chat.messages, chat.variables()).unwrap();
        assert_eq!(
            out,
            "assistant:|[{\"id\": \"c1\", \"function\": {\"arguments\": {}, \"name\": \"f\"}}]\n\
             [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"description\": null, \"parameters\": null}}] \
             False True on <B>"
        );
        // none and booleans print as Python prints them, as in Jinja2.
        let out = template
            .render(&chat.messages, Variables { add_generation_prompt: true, ..Variables::default() })
            .unwrap();
        assert!(out.ends_with("null True True  <s>"), "{out}");
    }

    /// `tool_reference` parts (Claude Code's tool search) reach the template as vLLM 0.33
    /// passes them: their names among the texts in the "string" format (none left out), as
    /// `{"type": "tool_reference", "name"}` parts in the "openai" one, where a tool turn with
    /// one keeps its parts apart. They are no media: the whole prompt is known.
    #[test]
    fn tool_references_reach_the_template_as_vllm_passes_them() {
        let body = br#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"tool_reference","name":"grep"}]},
            {"role":"tool","tool_call_id":"t","content":[{"type":"tool_reference","name":"glob"},{"type":"tool_reference"}]},
            {"role":"tool","content":[{"type":"text","text":"x"},{"type":"text","text":"y"}]}]}"#;
        let chat = crate::openai::ChatRequest::parse(body).unwrap();
        assert_eq!(chat.first_media(), None);
        let string = "{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}";
        let template = ChatTemplate::new(string, SpecialTokens::default()).unwrap();
        assert_eq!(
            template.render(&chat.messages, chat.variables()).unwrap(),
            "user:a\ngrep|tool:glob|tool:x\ny|"
        );
        let openai = "{% for m in messages %}{{ m.role }}:{% if m.content is string %}{{ m.content }}\
                      {% else %}{% for p in m.content %}{{ p | tojson }}{% endfor %}{% endif %}|{% endfor %}";
        let template = ChatTemplate::new(openai, SpecialTokens::default()).unwrap();
        assert_eq!(template.content_format(), ContentFormat::OpenAi);
        assert_eq!(
            template.render(&chat.messages, chat.variables()).unwrap(),
            r#"user:{"type": "text", "text": "a"}{"type": "tool_reference", "name": "grep"}|tool:{"type": "tool_reference", "name": "glob"}{"type": "tool_reference", "name": null}|tool:x
y|"#
        );
        let bad = br#"{"messages":[{"role":"tool","content":[{"type":"tool_reference","name":3}]}]}"#;
        assert!(crate::openai::ChatRequest::parse(bad).is_err(), "a name that is not a string");
        // A continued message ends in its last text part, as transformers finds it.
        let names = "{% for m in messages %}{{ m.role }}:{% if m.content is string %}{{ m.content }}{% else %}\
                     {% for p in m.content %}{{ p.text or p.name }}{% endfor %}{% endif %}|{% endfor %}";
        let template = ChatTemplate::new(names, SpecialTokens::default()).unwrap();
        let body = br#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"tool_reference","name":"g"}]}],
            "continue_final_message":true,"add_generation_prompt":false}"#;
        let chat = crate::openai::ChatRequest::parse(body).unwrap();
        assert_eq!(template.render(&chat.messages, chat.variables()).unwrap(), "user:a");
        // Merged system turns take no reference names (vLLM keeps parts with text).
        let body = br#"{"messages":[{"role":"user","content":"q"},
            {"role":"developer","content":[{"type":"text","text":"d"},{"type":"tool_reference","name":"g"}]}]}"#;
        let chat = crate::openai::ChatRequest::parse(body).unwrap();
        assert_eq!(template.render(&chat.messages, chat.variables()).unwrap(), "system:d|user:q|");
    }

    /// Floats a template writes are spelled as Jinja2 spells them (Python's `repr`), written
    /// out, through `string` (Qwen3-Coder's tool-call arguments) and through `tojson`. The
    /// expected line is Jinja2 3.1's rendering of the same template and arguments. A float of
    /// 17 digits is read as Python's `json.loads` reads it, correctly rounded.
    #[test]
    fn floats_are_written_as_python_writes_them() {
        let source = "{% for m in messages %}{% for tc in m.tool_calls %}{% for k, v in tc.function.arguments|items %}\
                      {{ k }}={{ v }}|{{ v|string }}|{{ v|tojson }};{% endfor %}{% endfor %}{% endfor %}";
        let template = ChatTemplate::new(source, SpecialTokens::default()).unwrap();
        let args = r#"{\"lr\": 1e-5, \"n\": 3, \"big\": 1e16, \"t\": 0.7, \"w\": 2.0, \"ok\": true, \"none\": null, \"x\": 442.96881516653684}"#;
        let body = format!(
            r#"{{"messages":[{{"role":"assistant","tool_calls":[{{"function":{{"name":"f","arguments":"{args}"}}}}]}}]}}"#
        );
        let chat = crate::openai::ChatRequest::parse(body.as_bytes()).unwrap();
        assert_eq!(
            template.render(&chat.messages, chat.variables()).unwrap(),
            "lr=1e-05|1e-05|1e-05;n=3|3|3;big=1e+16|1e+16|1e+16;t=0.7|0.7|0.7;w=2.0|2.0|2.0;\
             ok=True|True|true;none=None|None|null;\
             x=442.96881516653684|442.96881516653684|442.96881516653684;"
        );
        // The arguments whole, a dict printed (and through `string`): Python's repr, its
        // floats too. They were written as Rust writes them (`1e-5`, `1e16`).
        let source = "{% for m in messages %}{% for tc in m.tool_calls %}{{ tc.function.arguments }}\n\
                      {{ tc.function.arguments|string }}\n{{ [tc.function.arguments.t, 'a'] }}\n{{ ['b', 1] }}\
                      {% endfor %}{% endfor %}";
        let template = ChatTemplate::new(source, SpecialTokens::default()).unwrap();
        let whole = "{'lr': 1e-05, 'n': 3, 'big': 1e+16, 't': 0.7, 'w': 2.0, 'ok': True, 'none': None, \
                     'x': 442.96881516653684}";
        assert_eq!(
            template.render(&chat.messages, chat.variables()).unwrap(),
            format!("{whole}\n{whole}\n[0.7, 'a']\n['b', 1]")
        );
    }

    /// A template that loops over a message's content gets every content as a list of text
    /// parts, one for each the client sent (vLLM's "openai" format); any other gets them joined.
    #[test]
    fn a_template_that_loops_over_content_gets_the_parts_apart() {
        let chatml = ChatTemplate::builtin_default();
        assert_eq!(chatml.content_format(), ContentFormat::String);
        let looping = "{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}\
                       {% else %}{% for part in message['content'] %}<{{ part.text }}>{% endfor %}{% endif %}|{% endfor %}";
        let template = ChatTemplate::new(looping, SpecialTokens::default()).unwrap();
        assert_eq!(template.content_format(), ContentFormat::OpenAi);
        let body = br#"{"messages":[{"role":"user","content":[{"type":"text","text":"A"},{"type":"text","text":"B"}]},
            {"role":"assistant","content":"C"},{"role":"assistant","content":null},{"role":"user","content":""},
            {"role":"user","content":[{"type":"text","text":""},{"type":"text","text":"D"}]}]}"#;
        let chat = crate::openai::ChatRequest::parse(body).unwrap();
        // No content is no part; an empty string is one empty part, as vLLM makes them.
        assert_eq!(template.render(&chat.messages, chat.variables()).unwrap(), "<A><B>|<C>||<>|<><D>|");
        // The same source read as a string template joins the parts.
        let joined = looping
            .replace("message['content']", "message['content'] ")
            .replace("for part in message['content'] ", "for part in [message.content]");
        let template = ChatTemplate::new(&*joined, SpecialTokens::default()).unwrap();
        assert_eq!(template.content_format(), ContentFormat::String, "{joined}");
        assert_eq!(template.render(&chat.messages, chat.variables()).unwrap(), "A\nB|C|||D|");
        for (source, format) in [
            (
                "{%- for m in messages %}{%- for c in m.content | selectattr('type', 'eq', 'text') %}{{ c.text }}{% endfor %}{% endfor %}",
                ContentFormat::OpenAi,
            ),
            (
                "{% for m in messages[1:] %}{% for c in m[\"content\"] %}{% endfor %}{% endfor %}",
                ContentFormat::OpenAi,
            ),
            (
                "{% for m in messages %}{% endfor %}{% for c in tools.content %}{% endfor %}",
                ContentFormat::String,
            ),
            (
                "{% set loop_messages = messages[1:] %}{% for message in loop_messages %}\
                 {% for block in message['content'] %}{% endfor %}{% endfor %}",
                ContentFormat::OpenAi,
            ),
            (
                "{% for m in messages %}{% for line in m.content.split('\\n') %}{% endfor %}{% endfor %}",
                ContentFormat::String,
            ),
        ] {
            assert_eq!(ContentFormat::of_template(source), format, "{source}");
        }
    }

    /// vLLM dumps each tool through its pydantic model: its fields in their order, the
    /// unset ones null (`strict` and `defer_loading` left out), nothing else; a tool's own
    /// `defer_loading` goes to its function when that has none, and stays on the tool.
    #[test]
    fn tools_reach_the_template_as_vllm_dumps_them() {
        // (`strict` and `defer_loading` as pydantic's lax mode reads booleans: "no", 0, "Yes".)
        let template = ChatTemplate::new("{{ tools | tojson }}", SpecialTokens::default()).unwrap();
        let body = br#"{"messages":[{"role":"user","content":"q"}],"tools":[
            {"function":{"parameters":{"z":1,"a":2},"extra":0,"strict":null,"name":"f"},"type":"function","defer_loading":true},
            {"type":"function","function":{"name":"g","description":"G.","strict":"no"}},
            {"type":"function","function":{"name":"h","defer_loading":0},"defer_loading":"Yes"},
            {"type":"code_interpreter"}]}"#;
        let chat = crate::openai::ChatRequest::parse(body).unwrap();
        assert_eq!(
            template.render(&chat.messages, chat.variables()).unwrap(),
            r#"[{"type": "function", "function": {"name": "f", "description": null, "parameters": {"z": 1, "a": 2}, "defer_loading": true}, "defer_loading": true}, "#
                .to_owned()
                + r#"{"type": "function", "function": {"name": "g", "description": "G.", "parameters": null, "strict": false}}, "#
                + r#"{"type": "function", "function": {"name": "h", "description": null, "parameters": null, "defer_loading": false}, "defer_loading": true}, "#
                + r#"{"type": "code_interpreter"}]"#
        );
    }

    /// `reasoning_effort` reaches the template, and sets `enable_thinking` unless the
    /// request's `chat_template_kwargs` does.
    #[test]
    fn reasoning_effort_sets_enable_thinking_unless_the_kwargs_do() {
        let template =
            ChatTemplate::new("{{ reasoning_effort }} {{ enable_thinking }}", SpecialTokens::default())
                .unwrap();
        let render = |extra: &str| {
            let body = format!(r#"{{"messages":[{{"role":"user","content":"q"}}]{extra}}}"#);
            let chat = crate::openai::ChatRequest::parse(body.as_bytes())?;
            template.render(&chat.messages, chat.variables())
        };
        assert_eq!(render(r#","reasoning_effort":"high""#).unwrap(), "high True");
        assert_eq!(render(r#","reasoning_effort":"none""#).unwrap(), "none False");
        let kwargs = r#","chat_template_kwargs":{"enable_thinking":false,"reasoning_effort":"low"}"#;
        assert_eq!(render(&format!(r#"{kwargs},"reasoning_effort":"max""#)).unwrap(), "max False");
        assert_eq!(render(kwargs).unwrap(), "low False");
        assert_eq!(render("").unwrap(), " ");
        assert!(matches!(
            render(r#","reasoning_effort":"extreme""#),
            Err(RequestError::InvalidField { param: "reasoning_effort", .. })
        ));
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let v: Value = serde_json::from_str(r#"{"b": [1, "ü", null], "a": {"x": true}}"#).unwrap();
        let compact = tojson(&v, Kwargs::from_iter(Vec::<(&str, Value)>::new())).unwrap();
        assert_eq!(compact.as_str(), Some(r#"{"b": [1, "ü", null], "a": {"x": true}}"#));
        let pretty = tojson(&v, Kwargs::from_iter([("indent", Value::from(2))])).unwrap();
        assert_eq!(
            pretty.as_str(),
            Some("{\n  \"b\": [\n    1,\n    \"ü\",\n    null\n  ],\n  \"a\": {\n    \"x\": true\n  }\n}")
        );
        // The rest of `json.dumps`' arguments, each line as Python 3.11 writes it.
        let v: Value = serde_json::from_str(r#"{"b": [1, "ü😀", {}], "a": {"y": [], "x": true}}"#).unwrap();
        let dumps = |args: Vec<(&str, Value)>| tojson(&v, Kwargs::from_iter(args)).unwrap().to_string();
        let tight = Value::from(vec![",", ":"]);
        assert_eq!(dumps(vec![("separators", tight.clone())]), r#"{"b":[1,"ü😀",{}],"a":{"y":[],"x":true}}"#);
        assert_eq!(
            dumps(vec![("ensure_ascii", Value::from(true)), ("sort_keys", Value::from(true))]),
            r#"{"a": {"x": true, "y": []}, "b": [1, "\u00fc\ud83d\ude00", {}]}"#
        );
        assert_eq!(
            dumps(vec![("indent", Value::from(1)), ("separators", tight)]),
            "{\n \"b\":[\n  1,\n  \"ü😀\",\n  {}\n ],\n \"a\":{\n  \"y\":[],\n  \"x\":true\n }\n}"
        );
        assert!(tojson(&v, Kwargs::from_iter([("sort", Value::from(true))])).is_err(), "an unknown argument");
        // DEL is ASCII, and Python escapes it all the same (it was written raw).
        let del: Value = serde_json::from_str(r#"{"q": "a\u007fb", "r": "a\u007fü"}"#).unwrap();
        let ascii = tojson(&del, Kwargs::from_iter([("ensure_ascii", Value::from(true))])).unwrap();
        assert_eq!(ascii.to_string(), r#"{"q": "a\u007fb", "r": "a\u007f\u00fc"}"#);
        assert_eq!(python_json_dumps(&serde_json::json!({"q": "a\u{7f}b"})), r#"{"q": "a\u007fb"}"#);
        // An indent written at every level is bounded: a request's template could ask for
        // petabytes of spaces.
        for indent in [Value::from(1_000_000_000_000_000u64), Value::from("x".repeat(65))] {
            let refused = tojson(&v, Kwargs::from_iter([("indent", indent)])).unwrap_err();
            assert!(refused.to_string().contains("indent over 64"), "{refused}");
        }
        assert!(tojson(&v, Kwargs::from_iter([("indent", Value::from(64))])).is_ok());
    }

    /// `continue_final_message` cuts the prompt where the last text ends, as transformers
    /// 5.20 does: expected strings from its `render_jinja_template`.
    #[test]
    fn a_continued_final_message_ends_the_prompt_as_transformers_ends_it() {
        let render = |source: &str, messages: &str| {
            let template = ChatTemplate::new(source, SpecialTokens::default()).unwrap();
            let body = format!(
                r#"{{"messages":{messages},"continue_final_message":true,"add_generation_prompt":false}}"#
            );
            let chat = crate::openai::ChatRequest::parse(body.as_bytes()).unwrap();
            template.render(&chat.messages, chat.variables())
        };
        let hi = r#"{"role":"user","content":"Hi"}"#;
        assert_eq!(
            render(DEFAULT_CHAT_TEMPLATE, &format!(r#"[{hi},{{"role":"assistant","content":"Hello "}}]"#))
                .unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello "
        );
        assert_eq!(
            render(DEFAULT_CHAT_TEMPLATE, &format!(r#"[{hi},{{"role":"assistant","content":null}}]"#))
                .unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        // A template that trims the text trims the tag's space: the spaces before go too.
        let trimming =
            "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>{% endfor %}";
        assert_eq!(
            render(trimming, &format!(r#"[{hi},{{"role":"assistant","content":" Sure, here  "}}]"#)).unwrap(),
            "<user>Hi</user><assistant>Sure, here"
        );
        // In the "openai" content format, the last text part is the one continued.
        let parts = "{% for m in messages %}{% for p in m.content %}[{{ p.text }}]{% endfor %}|{% endfor %}";
        let last =
            r#"{"role":"assistant","content":[{"type":"text","text":"A"},{"type":"text","text":"B"}]}"#;
        assert_eq!(render(parts, &format!("[{hi},{last}]")).unwrap(), "[Hi]|[A][B");
        let refused = |source: &str, messages: &str| {
            matches!(render(source, messages), Err(RequestError::CannotContinue(_)))
        };
        assert!(refused(parts, &format!(r#"[{hi},{{"role":"assistant","content":null}}]"#)), "no text");
        // transformers looks for `content` in the source, not in what it renders.
        let unnamed = "{% for m in messages %}{{ m['cont' ~ 'ent'] }}{% endfor %}";
        assert!(refused(unnamed, &format!("[{hi}]")), "no content named");
        let dropping = "{% for m in messages[:-1] %}{{ m.content }}{% endfor %}";
        assert!(
            refused(dropping, &format!(r#"[{hi},{{"role":"assistant","content":"Yo"}}]"#)),
            "not rendered"
        );
        // Without it the same template renders the whole message.
        let body = format!(r#"{{"messages":[{hi},{last}],"add_generation_prompt":false}}"#);
        let chat = crate::openai::ChatRequest::parse(body.as_bytes()).unwrap();
        let template = ChatTemplate::new(parts, SpecialTokens::default()).unwrap();
        assert_eq!(template.render(&chat.messages, chat.variables()).unwrap(), "[Hi]|[A][B]|");
    }

    /// The request's `add_generation_prompt` wins over its `chat_template_kwargs`' (vLLM 0.33
    /// merges the request's fields over the kwargs); `continue_final_message` is no template
    /// variable.
    #[test]
    fn the_requests_generation_prompt_wins_over_its_kwargs() {
        let template = ChatTemplate::new(
            "{{ add_generation_prompt }} {{ continue_final_message is defined }}",
            SpecialTokens::default(),
        )
        .unwrap();
        let body = br#"{"messages":[{"role":"user","content":"q"}],
            "chat_template_kwargs":{"add_generation_prompt":false,"continue_final_message":true}}"#;
        let chat = crate::openai::ChatRequest::parse(body).unwrap();
        assert_eq!(template.render(&chat.messages, chat.variables()).unwrap(), "True False");
    }

    /// For a template that does not name the `developer` role, vLLM makes developer turns
    /// system ones, and then merges every system turn into a first one if one is not first.
    #[test]
    fn developer_turns_become_system_ones_for_a_template_without_them() {
        let chatml = ChatTemplate::builtin_default();
        let render = |template: &ChatTemplate, messages: &str| {
            let body = format!(r#"{{"messages":{messages},"add_generation_prompt":false}}"#);
            let chat = crate::openai::ChatRequest::parse(body.as_bytes()).unwrap();
            template.render(&chat.messages, chat.variables()).unwrap()
        };
        let first = r#"[{"role":"developer","content":"D"},{"role":"user","content":"U"}]"#;
        assert_eq!(
            render(&chatml, first),
            "<|im_start|>system\nD<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
        );
        let later = r#"[{"role":"system","content":"S","name":"n"},{"role":"user","content":"U"},
            {"role":"developer","content":[{"type":"text","text":"D1"},{"type":"text","text":"D2"}]},
            {"role":"system","content":""},{"role":"assistant","content":"A"}]"#;
        assert_eq!(
            render(&chatml, later),
            "<|im_start|>system\nS\n\nD1\nD2<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
        );
        // Without a developer turn, system turns stay where they are.
        let inline = r#"[{"role":"user","content":"U"},{"role":"system","content":"S"}]"#;
        assert_eq!(
            render(&chatml, inline),
            "<|im_start|>user\nU<|im_end|>\n<|im_start|>system\nS<|im_end|>\n"
        );
        // A template that names the role gets it, with the turn's tools (null if none).
        let knowing = ChatTemplate::new(
            "{% for m in messages %}{{ m.role }}:{{ m.content }}\
             {% if m.role == 'developer' %}:{{ m.tools | tojson }}{% endif %}|{% endfor %}",
            SpecialTokens::default(),
        )
        .unwrap();
        assert_eq!(render(&knowing, first), "developer:D:null|user:U|");
        let tools = r#"[{"role":"developer","content":"D","tools":[{"type":"function"}]}]"#;
        assert_eq!(render(&knowing, tools), r#"developer:D:[{"type": "function"}]|"#);
    }

    /// In the "openai" content format a tool turn's text parts reach the template as one
    /// string (empty parts too), and a string `task` is passed on.
    #[test]
    fn a_tool_turns_parts_are_one_string_and_a_task_is_passed() {
        let template = ChatTemplate::new(
            "{% for m in messages %}{% if m.content is string %}S[{{ m.content }}]\
             {% else %}{% for p in m.content %}<{{ p.text }}>{% endfor %}{% endif %}{{ m.task }}|{% endfor %}",
            SpecialTokens::default(),
        )
        .unwrap();
        assert_eq!(template.content_format(), ContentFormat::OpenAi);
        let body = br#"{"messages":[{"role":"user","content":[{"type":"text","text":"q"}],"task":"t"},
            {"role":"tool","content":[{"type":"text","text":"a"},{"type":"text","text":""},{"type":"text","text":"b"}]},
            {"role":"tool","content":null},{"role":"tool","content":"c"}]}"#;
        let chat = crate::openai::ChatRequest::parse(body).unwrap();
        assert_eq!(template.render(&chat.messages, chat.variables()).unwrap(), "<q>t|S[a\n\nb]|S[]|S[c]|");
    }

    /// A request's `documents` reach the template, over its kwargs' (vLLM merges them so).
    #[test]
    fn documents_reach_the_template() {
        let template = ChatTemplate::new(
            "{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}",
            SpecialTokens::default(),
        )
        .unwrap();
        let render = |extra: &str| {
            let body = format!(r#"{{"messages":[{{"role":"user","content":"q"}}]{extra}}}"#);
            let chat = crate::openai::ChatRequest::parse(body.as_bytes()).unwrap();
            template.render(&chat.messages, chat.variables()).unwrap()
        };
        let kwargs = r#","chat_template_kwargs":{"documents":[{"title":"K","text":"k"}]}"#;
        assert_eq!(
            render(r#","documents":[{"title":"A","text":"a"},{"title":"B","text":"b"}]"#),
            "[A: a][B: b]"
        );
        assert_eq!(render(&format!(r#"{kwargs},"documents":[{{"title":"A","text":"a"}}]"#)), "[A: a]");
        assert_eq!(render(&format!(r#"{kwargs},"documents":null"#)), "[K: k]");
        assert_eq!(render(""), "");
    }
}
