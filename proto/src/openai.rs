//! Turning an OpenAI request into token ids and a cache namespace, identically in the router
//! and the replica agent (feature `openai`).
//!
//! The router predicts which replica holds a request's prefix by hashing the request's
//! tokens, so parsing, chat-template rendering and tokenization are part of the wire
//! contract: both sides build a [`Tokenization`] from the same [`TokenizationConfig`] and
//! call [`Tokenization::prompt_tokens`] and [`Tokenization::namespace`].
//!
//! - [`request`]: lenient, borrowing parsing of `/v1/completions` and `/v1/chat/completions`.
//! - [`tokenizer`]: the [`Tokenizer`] seam, the file-free [`Builtin`] tokenizer and
//!   [`HuggingFace`] `tokenizer.json` support.
//! - [`chat_template`]: Jinja chat templates rendered as Hugging Face / vLLM render them.
//! - [`error`]: [`RequestError`] (→ OpenAI error JSON via [`OpenAiError`]) and [`LoadError`].
//!
//! What vLLM does, and so what this does: completion text prompts are encoded with the
//! tokenizer's special tokens (BOS) unless the request says `add_special_tokens: false`;
//! token-id prompts are used as they are (checked against the vocabulary); chat requests are
//! rendered with the template and the result encoded *without* special tokens (the template
//! writes them).
//!
//! # Choosing the chat template
//!
//! 1. `chat_template` in the config (a Jinja file, or a `tokenizer_config.json`) wins: it is
//!    the replicas' `--chat-template`;
//! 2. else the model's own: a `chat_template.jinja` beside the `tokenizer_config` (the
//!    configured one, else the one beside the `tokenizer.json`, as vLLM reads a model's
//!    directory: [`TokenizerSpec::model_files`]; and
//!    `additional_chat_templates/tool_use.jinja`), else that config's `chat_template`
//!    ([`ChatTemplate::from_tokenizer_config`]);
//! 3. else, for the builtin tokenizer, [`DEFAULT_CHAT_TEMPLATE`] (ChatML);
//! 4. else there is none and chat requests fail with [`RequestError::NoChatTemplate`].
//!
//! The named special tokens (`bos_token`, `eos_token`, ...) come from that
//! `tokenizer_config` if there is one, else from [`SpecialTokens::builtin`] for the builtin tokenizer; a token the
//! tokenizer does not set is no template variable ([`SpecialTokens`]).

pub mod chat_template;
pub mod error;
pub mod harmony;
pub mod prefix_cache;
pub mod request;
pub mod tokenizer;

use std::borrow::Cow;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::RwLock;

use serde::{Deserialize, Serialize};

pub use chat_template::{
    ChatOptions, ChatTemplate, ContentFormat, ContentFormatOption, DEFAULT_CHAT_TEMPLATE, JsonObject,
    SpecialTokens, Variables,
};
pub use error::{LoadError, MessageProblem, OpenAiError, RequestError};
pub use prefix_cache::{PrefixCache, PrefixCacheStats};
pub use request::anthropic::{InlineSystem, inline_system_mode};
pub use request::{
    ChatRequest, CompletionRequest, EmbedsRequest, Endpoint, Message, ParsedRequest, Prompt, PromptInput,
    Side, Truncation,
};
pub use tokenizer::{Builtin, HuggingFace, Tokenizer};

use crate::{BlockHash, CacheNamespace};

/// Tokens a chat's media may take beyond its text, for `truncate_prompt_tokens: -1`: with
/// less room than the text and this, vLLM may cut the prompt, and which tokens stay is not
/// known here (a large image is a few thousand tokens).
const MEDIA_ROOM: u64 = 16_384;

/// Everything that decides a request's token ids and namespace. The router and every agent
/// of one model must be given equal configs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizationConfig {
    /// The model the replicas serve: the namespace `model` of every request.
    pub base_model: String,
    /// Request `model` values that name LoRA adapters of `base_model`.
    #[serde(default)]
    pub lora_adapters: Vec<String>,
    /// Which tokenizer to run.
    #[serde(default)]
    pub tokenizer: TokenizerSpec,
    /// A Hugging Face `tokenizer_config.json`: special tokens and, usually, the chat template.
    /// Unset, the one beside the `tokenizer.json` is read, if there is one
    /// ([`TokenizerSpec::model_files`]).
    #[serde(default)]
    pub tokenizer_config: Option<PathBuf>,
    /// A chat template file (Jinja, or a `tokenizer_config.json`), overriding the one in
    /// `tokenizer_config`.
    #[serde(default)]
    pub chat_template: Option<PathBuf>,
    /// The fleet's vLLM flags that change how chats are rendered.
    #[serde(default)]
    pub chat: ChatOptions,
}

/// Which tokenizer a [`Tokenization`] runs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TokenizerSpec {
    /// The file-free [`Builtin`] tokenizer.
    #[default]
    Builtin,
    /// A `tokenizer.json` file.
    HuggingFace {
        /// Path of the `tokenizer.json`, or of the model's directory that holds it.
        path: PathBuf,
    },
}

/// The tokenizer files of a model directory, as vLLM and transformers find them there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelFiles {
    /// The `tokenizer.json`.
    pub tokenizer: PathBuf,
    /// The `tokenizer_config.json` beside it, if there is one: its special tokens and, with
    /// a `chat_template.jinja` beside it or inside it, the model's chat template.
    pub tokenizer_config: Option<PathBuf>,
}

impl TokenizerSpec {
    /// The files a Hugging Face tokenizer is loaded from: `path` itself, or `tokenizer.json`
    /// inside it when it is a directory, and the `tokenizer_config.json` beside that; `None`
    /// for the builtin tokenizer.
    pub fn model_files(&self) -> Option<ModelFiles> {
        let TokenizerSpec::HuggingFace { path } = self else { return None };
        let tokenizer = if path.is_dir() { path.join("tokenizer.json") } else { path.clone() };
        let tokenizer_config = tokenizer.with_file_name("tokenizer_config.json");
        Some(ModelFiles {
            tokenizer_config: tokenizer_config.is_file().then_some(tokenizer_config),
            tokenizer,
        })
    }
}

/// Why `path`, given as `flag`, cannot be a model's tokenizer, if it cannot: it must be a
/// `tokenizer.json` or a directory holding one.
pub fn tokenizer_path_problem(flag: &str, path: &Path) -> Option<String> {
    let spec = TokenizerSpec::HuggingFace { path: path.to_owned() };
    let files = spec.model_files()?;
    (!files.tokenizer.is_file()).then(|| match path.is_dir() {
        true => format!("{flag} {} is a directory without a tokenizer.json", path.display()),
        false => format!("{flag} {} is not a readable file", path.display()),
    })
}

/// The one entry point both the router and the replica agent use to get a request's token
/// ids and cache namespace.
#[derive(Debug)]
pub struct Tokenization {
    tokenizer: Box<dyn Tokenizer>,
    chat_template: Option<ChatTemplate>,
    base_model: String,
    /// The LoRA adapters requests may name: configured, or loaded since
    /// ([`Tokenization::add_lora_adapter`]).
    lora_adapters: RwLock<HashSet<String>>,
    /// Token ids of texts' beginnings seen before, when enabled.
    prefix_cache: Option<PrefixCache>,
    /// Where a Messages request's inline system messages go with this chat template.
    inline_system: InlineSystem,
    /// The fleet's chat flags (the template has them too; remote tokenization needs them
    /// without one).
    chat_options: ChatOptions,
    /// Chats with a Harmony template are rendered with the template all the same (a fleet
    /// whose engine does so: [`Tokenization::render_as_sglang`]).
    harmony_off: bool,
    /// See [`Tokenization::template_problem`].
    template_problem: Option<String>,
    /// See [`Tokenization::context_len`]; 0 until known.
    context_len: std::sync::atomic::AtomicU64,
}

impl Tokenization {
    /// Loads the tokenizer and chat template `config` names (see the module docs for how
    /// the template is chosen).
    pub fn new(config: &TokenizationConfig) -> Result<Self, LoadError> {
        let files = config.tokenizer.model_files();
        let builtin = files.is_none();
        // The model's own tokenizer_config.json, found beside its tokenizer.json, unless one is
        // configured.
        let tokenizer_config =
            config.tokenizer_config.clone().or(files.as_ref().and_then(|f| f.tokenizer_config.clone()));
        // One found rather than given that cannot be read (or whose template does not
        // compile) stops nothing: chats are refused as without a template, completions served,
        // and the problem is told ([`Tokenization::template_problem`]).
        let found = config.tokenizer_config.is_none();
        // A given template needs the config's special tokens (its `bos_token`, say): without
        // them it would render wrong, not refuse.
        let special_found = found && config.chat_template.is_none();
        let mut problem = None;
        let mut lenient = |e: LoadError| {
            if !found {
                return Err(e);
            }
            problem = Some(e.to_string());
            Ok(())
        };
        let special = match &tokenizer_config {
            Some(path) => match SpecialTokens::from_tokenizer_config(path) {
                Ok(special) => special,
                Err(e) if special_found => {
                    lenient(e)?;
                    SpecialTokens::default()
                }
                Err(e) => return Err(e),
            },
            None if builtin => SpecialTokens::builtin(),
            None => SpecialTokens::default(),
        };
        let tokenizer: Box<dyn Tokenizer> = match &files {
            None => Box::new(Builtin),
            Some(files) => {
                let tokenizer = HuggingFace::from_file(&files.tokenizer)?;
                // A config that cannot be read was dealt with above.
                match tokenizer_config.as_ref().map(chat_template::bos_eos_flags) {
                    Some(Ok(Some((add_bos, add_eos)))) => {
                        let bos = special.get("bos_token").filter(|_| add_bos);
                        let eos = special.get("eos_token").filter(|_| add_eos);
                        let path = tokenizer_config.clone().unwrap_or_default();
                        Box::new(
                            tokenizer
                                .with_bos_eos(bos, eos)
                                .map_err(|why| LoadError::Tokenizer { path, source: why.into() })?,
                        )
                    }
                    _ => Box::new(tokenizer),
                }
            }
        };
        let chat_template = match (&config.chat_template, &tokenizer_config) {
            (Some(path), _) => Some(ChatTemplate::from_file(path, special)?.as_chat_template_flag()),
            (None, Some(path)) => match ChatTemplate::from_tokenizer_config(path) {
                Ok(t) => Some(t),
                Err(LoadError::NoChatTemplate { .. }) => None,
                Err(e) => {
                    lenient(e)?;
                    None
                }
            },
            (None, None) if builtin => Some(ChatTemplate::builtin_default()),
            (None, None) => None,
        }
        .map(|template| template.with_options(config.chat.clone()));
        let mut tokenization = Self::from_parts(
            tokenizer,
            chat_template,
            &config.base_model,
            config.lora_adapters.iter().cloned(),
        );
        tokenization.chat_options = config.chat.clone();
        tokenization.template_problem = problem;
        Ok(tokenization)
    }

    /// Why the `tokenizer_config.json` found beside the tokenizer gave no chat template or
    /// special tokens, if it could not be used.
    pub fn template_problem(&self) -> Option<&str> {
        self.template_problem.as_deref()
    }

    /// Assembles a tokenization from already-built parts (tests, custom tokenizers).
    pub fn from_parts(
        tokenizer: Box<dyn Tokenizer>,
        chat_template: Option<ChatTemplate>,
        base_model: impl Into<String>,
        lora_adapters: impl IntoIterator<Item = String>,
    ) -> Self {
        let inline_system = chat_template.as_ref().map_or(InlineSystem::default(), inline_system_mode);
        Self {
            inline_system,
            tokenizer,
            chat_template,
            base_model: base_model.into(),
            lora_adapters: RwLock::new(lora_adapters.into_iter().collect()),
            prefix_cache: None,
            chat_options: ChatOptions::default(),
            harmony_off: false,
            template_problem: None,
            context_len: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Renders chats as SGLang renders them: with the chat template even when it is in
    /// Harmony's format (SGLang renders gpt-oss chat completions with the model's template,
    /// where vLLM uses Harmony), and with SGLang's ways where they differ from vLLM's
    /// ([`ChatTemplate::render_as_sglang`]).
    pub fn render_as_sglang(&mut self) {
        self.harmony_off = true;
        if let Some(template) = &mut self.chat_template {
            template.render_as_sglang();
        }
    }

    /// The fleet's chat flags ([`ChatOptions`]).
    pub fn chat_options(&self) -> &ChatOptions {
        &self.chat_options
    }

    /// Keeps about `capacity_bytes` of texts' beginnings and their ids, so that text which
    /// begins like an earlier one is tokenized only from where it differs ([`PrefixCache`];
    /// the ids are the same either way). Fails, saying why, when the tokenizer cannot resume
    /// part-way through a text.
    pub fn enable_prefix_cache(&mut self, capacity_bytes: u64) -> Result<(), String> {
        self.tokenizer.resume().map_err(str::to_owned)?;
        self.prefix_cache = Some(PrefixCache::new(capacity_bytes));
        Ok(())
    }

    /// The prefix cache's counters, when it is enabled.
    pub fn prefix_cache_stats(&self) -> Option<PrefixCacheStats> {
        self.prefix_cache.as_ref().map(PrefixCache::stats)
    }

    /// The tokenizer in use.
    pub fn tokenizer(&self) -> &dyn Tokenizer {
        &*self.tokenizer
    }

    /// The chat template in use, if any.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// The token ids of every prompt of `request`, one list per prompt (a completion
    /// request with a batch prompt has several; a chat request has one).
    pub fn prompt_tokens(&self, request: &ParsedRequest<'_>) -> Result<Vec<Vec<u32>>, RequestError> {
        match request {
            ParsedRequest::Completion(r) => r
                .prompt
                .inputs()
                .into_iter()
                .map(|input| match input {
                    PromptInput::Text(text) => self.encode(text, r.add_special_tokens),
                    // Checked once truncated, as vLLM checks them: ids cut off are never read.
                    PromptInput::Tokens(ids) => {
                        self.check_ids(self.truncated(ids.to_vec(), r.truncation, false))
                    }
                })
                .map(|ids| match r.prompt {
                    Prompt::Text(_) | Prompt::TextBatch(_) => {
                        Ok(self.truncated(ids?, r.truncation, r.add_special_tokens))
                    }
                    Prompt::Tokens(_) | Prompt::TokensBatch(_) => ids,
                })
                .collect(),
            ParsedRequest::Chat(r) => {
                if let Some((index, part_type)) = r.first_media() {
                    let part_type = part_type.to_owned();
                    return Err(RequestError::UnsupportedContentPart { index, part_type });
                }
                // Untruncated: vLLM's Harmony path never applies `truncate_prompt_tokens`.
                if let Some(ids) = self.harmony_ids(r)? {
                    return Ok(vec![ids]);
                }
                let ids = self.encode(&self.render_chat(r)?, r.add_special_tokens)?;
                Ok(vec![self.truncated(ids, r.truncation, r.add_special_tokens)])
            }
        }
    }

    /// What can be known of the tokens of a chat with media ([`ChatRequest::first_media`];
    /// [`Tokenization::prompt_tokens`] refuses those): the ones its prompt certainly begins
    /// with, and how many of its tokens are text. (For a chat without media, all of them.)
    ///
    /// The messages before the first one with media are rendered alone, with no generation
    /// prompt, and tokenized; of those tokens, the ones that the whole conversation's tokens
    /// begin with too, rendered both with the media left out and with them as OpenAI-style
    /// parts ([`ChatTemplate::render_with_media`]; when the template cannot take those, the
    /// first alone), are certain. When the template renders each message on its own, that is
    /// all of them; when it does not (it counts the messages, or leaves out its default
    /// system prompt when there are images, as Llama 3.2 Vision's does), only what the
    /// renderings share; when the rendering fails, none. The count of text tokens is the
    /// whole rendering's (media left out), or without one [`PartialPrompt::estimated`].
    pub fn partial_chat_tokens(&self, request: &ChatRequest<'_>) -> Result<PartialPrompt, RequestError> {
        let Some((first, _)) = request.first_media() else {
            let tokens = self.encode(&self.render_chat(request)?, request.add_special_tokens)?;
            let tokens = self.truncated(tokens, request.truncation, request.add_special_tokens);
            return Ok(PartialPrompt { text_tokens: tokens.len(), tokens });
        };
        // Refused as the whole rendering would be (the estimates below do not render it).
        let sglang = self.chat_template.as_ref().is_some_and(ChatTemplate::renders_as_sglang);
        if request.continue_final_message && request.add_generation_prompt && !self.is_harmony() && !sglang {
            return Err(RequestError::CannotContinue(chat_template::CONTINUE_WITH_GENERATION_PROMPT));
        }
        // vLLM truncates once the media's tokens are in: which tokens stay is not known here.
        // `-1` cuts nothing while the context is unknown, or larger than the text and output
        // by more than the media (checked below, once the text is counted).
        let to_context = match request.truncation.map(|t| t.keep) {
            None => None,
            Some(request::Keep::Context { output }) => self.context_len().map(|c| c.saturating_sub(output)),
            Some(request::Keep::Tokens(_)) => return Ok(PartialPrompt::estimated(request)),
        };
        let template = self.chat_template.as_ref().ok_or(RequestError::NoChatTemplate)?;
        let vars = request.variables();
        let encode = |text: String| self.encode(&text, request.add_special_tokens).unwrap_or_default();
        let Ok(whole) = template.render(&request.messages, vars) else {
            return Ok(PartialPrompt::estimated(request));
        };
        let whole = encode(whole);
        if to_context.is_some_and(|room| whole.len() as u64 + MEDIA_ROOM >= room) {
            return Ok(PartialPrompt::estimated(request));
        }
        let with_media = template.render_with_media(&request.messages, vars).ok();
        let before = match first {
            0 => Vec::new(),
            _ => template
                .render(&request.messages[..first], Variables { beginning: true, ..vars })
                .map_or_else(|_| Vec::new(), encode),
        };
        let agreed = |ids: &[u32]| before.iter().zip(ids).take_while(|(a, b)| a == b).count();
        let certain = match with_media.map(encode) {
            Some(with_media) => agreed(&whole).min(agreed(&with_media)),
            None => agreed(&whole),
        };
        Ok(PartialPrompt { tokens: before[..certain].to_vec(), text_tokens: whole.len() })
    }

    /// [`Tokenization::prompt_tokens`], moving token-id prompts out of `request` (which is
    /// left with an empty prompt) instead of copying them.
    pub fn take_prompt_tokens(&self, request: &mut ParsedRequest<'_>) -> Result<Vec<Vec<u32>>, RequestError> {
        let truncation = request.truncation();
        // Checked once truncated, as vLLM checks them: ids cut off are never read.
        let cut = |ids: Vec<u32>| {
            let ids = self.truncated(ids, truncation, false);
            self.check_range(&ids).map(|()| ids)
        };
        if let ParsedRequest::Completion(r) = request {
            match &mut r.prompt {
                Prompt::Tokens(ids) => return Ok(vec![cut(std::mem::take(ids))?]),
                Prompt::TokensBatch(batch) => {
                    return std::mem::take(batch).into_iter().map(cut).collect();
                }
                Prompt::Text(_) | Prompt::TextBatch(_) => {}
            }
        }
        self.prompt_tokens(request)
    }

    /// The endpoint whose parser reads `body`, and the body it reads: a Messages body becomes
    /// the chat completion request vLLM makes of it (its inline system messages placed as
    /// vLLM places them with this chat template, [`request::anthropic::inline_system_mode`]),
    /// a Responses body the chat request that renders to its prompt (for gpt-oss, the one whose
    /// Harmony rendering is vLLM's of its items), a `/generate` body (SGLang's) the completion
    /// it amounts to; the others are read as they are.
    pub fn readable<'b>(
        &self,
        endpoint: Endpoint,
        body: &'b [u8],
    ) -> Result<(Endpoint, Cow<'b, [u8]>), RequestError> {
        Self::readable_with(endpoint, body, self.inline_system, self.is_harmony())
    }

    /// [`Tokenization::readable`], inline system messages placed as `inline` says (for a
    /// router whose replicas' template is not its own), Responses items read for Harmony
    /// when `harmony`.
    pub fn readable_with(
        endpoint: Endpoint,
        body: &[u8],
        inline: InlineSystem,
        harmony: bool,
    ) -> Result<(Endpoint, Cow<'_, [u8]>), RequestError> {
        match endpoint {
            Endpoint::Messages => Ok((
                Endpoint::ChatCompletions,
                Cow::Owned(request::anthropic::chat_body(body, inline, harmony)?),
            )),
            Endpoint::Responses => {
                let request = request::responses::Responses::read_as(body, harmony)?;
                if request.previous_response_id.is_some() {
                    return Err(RequestError::StoredConversation);
                }
                Ok((Endpoint::ChatCompletions, Cow::Owned(request.chat_body(&[]))))
            }
            Endpoint::Generate => {
                Ok((Endpoint::Completions, Cow::Owned(request::sglang::completion_body(body)?)))
            }
            endpoint => Ok((endpoint, Cow::Borrowed(body))),
        }
    }

    /// Where a Messages request's inline system messages go with this chat template.
    pub fn inline_system(&self) -> InlineSystem {
        self.inline_system
    }

    /// Whether this model's chats are rendered with Harmony, as vLLM renders gpt-oss's
    /// ([`ChatTemplate::is_harmony`]; not after [`Tokenization::render_as_sglang`]).
    pub fn is_harmony(&self) -> bool {
        !self.harmony_off && self.chat_template.as_ref().is_some_and(ChatTemplate::is_harmony)
    }

    /// The token ids of a chat that vLLM renders with Harmony rather than its template
    /// (gpt-oss, [`ChatTemplate::is_harmony`]; [`harmony`]), `None` for any other chat, and
    /// for one whose tools vLLM refuses (the replica answers it with a 400), which is
    /// rendered with the template. vLLM's `/tokenize` renders every chat with the template, so
    /// remote tokenization asks this first.
    pub fn harmony_ids(&self, request: &ChatRequest<'_>) -> Result<Option<Vec<u32>>, RequestError> {
        let Some(template) = self.chat_template.as_ref().filter(|_| self.is_harmony()) else {
            return Ok(None);
        };
        let options = template.options();
        let vars = request.variables();
        let tools = match options.tools(&vars) {
            Some(raw) => match harmony::Tool::list(raw.get()) {
                Some(tools) => tools,
                None => return Ok(None),
            },
            None => Vec::new(),
        };
        // vLLM's `VLLM_SYSTEM_START_DATE or today`: empty is unset.
        let date = std::env::var("VLLM_SYSTEM_START_DATE")
            .ok()
            .filter(|d| !d.is_empty())
            .unwrap_or_else(chat_template::today);
        // As vLLM reads it: an integer, not zero.
        let system_instructions = std::env::var("VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS")
            .is_ok_and(|v| v.trim().parse::<i64>().is_ok_and(|v| v != 0));
        let chat = harmony::HarmonyChat {
            messages: &request.messages,
            reasoning_effort: options.effort(vars.reasoning_effort),
            tools: &tools,
            date: &date,
            system_instructions,
        };
        let pieces = harmony::render(&chat)?;
        let mut ids = Vec::new();
        // Each text is encoded on its own, and most are the same as in the conversation's
        // previous request (the system and developer messages, the history, the headers):
        // through the prefix cache, only new ones are encoded (a 40-turn agent conversation
        // of 17.7 k tokens: 22 ms from scratch, 0.23 ms again, with o200k's tokenizer).
        let encode = |text: &str| self.tokenizer.encode_ordinary(text);
        let mut specials: Vec<(&str, u32)> = Vec::new();
        for piece in &pieces {
            match piece {
                harmony::Piece::Text(text) => match &self.prefix_cache {
                    Some(cache) if !text.is_empty() => ids.extend(cache.encode_whole(text, encode)?),
                    _ => ids.extend(encode(text)?),
                },
                harmony::Piece::Special(token) => {
                    // A handful of tokens, each looked up once.
                    let id = match specials.iter().find(|(t, _)| t == token) {
                        Some(&(_, id)) => id,
                        None => match self.tokenizer.encode(token, false)?[..] {
                            [id] => {
                                specials.push((token, id));
                                id
                            }
                            _ => {
                                return Err(RequestError::Harmony(format!(
                                    "the tokenizer has no {token} token"
                                )));
                            }
                        },
                    };
                    ids.push(id);
                }
            }
        }
        Ok(Some(ids))
    }

    /// The prompt string a chat request renders to.
    pub fn render_chat(&self, request: &ChatRequest<'_>) -> Result<String, RequestError> {
        let template = self.chat_template.as_ref().ok_or(RequestError::NoChatTemplate)?;
        template.render(&request.messages, request.variables())
    }

    /// The model every request's blocks are hashed under.
    pub fn base_model(&self) -> &str {
        &self.base_model
    }

    /// Whether requests for `model` are for a LoRA adapter of the base model.
    pub fn is_lora_adapter(&self, model: &str) -> bool {
        self.adapters().contains(model)
    }

    /// The LoRA adapters requests may name, sorted.
    pub fn lora_adapters(&self) -> Vec<String> {
        let mut names: Vec<String> = self.adapters().iter().cloned().collect();
        names.sort();
        names
    }

    /// Adds a LoRA adapter loaded at run time (vLLM's `/v1/load_lora_adapter`); false if it
    /// was there already.
    pub fn add_lora_adapter(&self, name: &str) -> bool {
        self.lora_adapters.write().unwrap_or_else(|e| e.into_inner()).insert(name.to_owned())
    }

    /// Removes a LoRA adapter (vLLM's `/v1/unload_lora_adapter`); false if it was not there.
    pub fn remove_lora_adapter(&self, name: &str) -> bool {
        self.lora_adapters.write().unwrap_or_else(|e| e.into_inner()).remove(name)
    }

    fn adapters(&self) -> std::sync::RwLockReadGuard<'_, HashSet<String>> {
        self.lora_adapters.read().unwrap_or_else(|e| e.into_inner())
    }

    /// The cache namespace of `request` under this config; see [`namespace`].
    pub fn namespace(&self, request: &ParsedRequest<'_>) -> CacheNamespace {
        namespace(request, &self.base_model, |m| self.is_lora_adapter(m))
    }

    /// The block hashes of every prompt of `request`: [`Tokenization::prompt_tokens`]
    /// chained in [`Tokenization::namespace`].
    pub fn block_hashes(
        &self,
        request: &ParsedRequest<'_>,
        block_size: usize,
    ) -> Result<Vec<Vec<BlockHash>>, RequestError> {
        let ns = self.namespace(request);
        Ok(self.prompt_tokens(request)?.iter().map(|tokens| ns.chain(tokens, block_size)).collect())
    }

    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, RequestError> {
        let ids = match (&self.prefix_cache, self.tokenizer.resume()) {
            (Some(cache), Ok(resume)) => cache.encode(resume, text, add_special_tokens)?,
            _ => self.tokenizer.encode(text, add_special_tokens)?,
        };
        if ids.is_empty() {
            return Err(RequestError::EmptyPrompt);
        }
        Ok(ids)
    }

    /// A prompt's ids as the replica keeps them ([`Truncation`]), `special` when they were
    /// encoded from text with the tokenizer's special tokens (the ids of a text the replica
    /// encoded, for remote tokenization, go through here too).
    pub fn truncated(&self, ids: Vec<u32>, truncation: Option<Truncation>, special: bool) -> Vec<u32> {
        let Some(truncation) = truncation else { return ids };
        let context = self.context_len();
        if truncation.kept(context).is_none_or(|k| ids.len() <= k) {
            return ids;
        }
        // Only the tokenizer's own (left) truncation keeps them apart.
        let specials = match special && truncation.side.is_none() {
            true => self.tokenizer.encode("", true).unwrap_or_default(),
            false => Vec::new(),
        };
        truncation.apply(ids, &specials, context)
    }

    /// The model's context length (`max_model_len`), once a replica's model card told it:
    /// what `truncate_prompt_tokens: -1` keeps, less the output tokens.
    pub fn context_len(&self) -> Option<u64> {
        Some(self.context_len.load(std::sync::atomic::Ordering::Relaxed)).filter(|&n| n > 0)
    }

    /// Sets [`Self::context_len`] (0: unknown).
    pub fn set_context_len(&self, tokens: u64) {
        self.context_len.store(tokens, std::sync::atomic::Ordering::Relaxed);
    }

    fn check_ids(&self, ids: Vec<u32>) -> Result<Vec<u32>, RequestError> {
        self.check_range(&ids).map(|()| ids)
    }

    /// Every id is below the vocabulary size.
    fn check_range(&self, ids: &[u32]) -> Result<(), RequestError> {
        let vocab_size = self.tokenizer.vocab_size();
        // A pass without an exit per id (it vectorizes), then the first culprit if any.
        if !ids.iter().fold(false, |out, &id| out | (id >= vocab_size)) {
            return Ok(());
        }
        match ids.iter().find(|&&id| id >= vocab_size) {
            Some(&token_id) => Err(RequestError::TokenIdOutOfRange { token_id, vocab_size }),
            None => Ok(()),
        }
    }
}

/// What [`Tokenization::partial_chat_tokens`] knows of a prompt.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PartialPrompt {
    /// The token ids the prompt certainly begins with.
    pub tokens: Vec<u32>,
    /// The prompt's text tokens, those above included; the media's own are not known.
    pub text_tokens: usize,
}

impl PartialPrompt {
    /// Nothing certain, and text tokens estimated from the messages' text at one a
    /// [`PartialPrompt::BYTES_PER_TOKEN`] (English text runs about that with most
    /// tokenizers): for the load a chat brings, and the router's prompt limit.
    pub fn estimated(request: &ChatRequest<'_>) -> Self {
        Self { tokens: Vec::new(), text_tokens: request.text_bytes().div_ceil(Self::BYTES_PER_TOKEN) }
    }

    /// See [`PartialPrompt::estimated`].
    pub const BYTES_PER_TOKEN: usize = 4;
}

/// The cache namespace of `request`: the model is always `base_model`; the LoRA adapter is
/// the request's `model` when `is_adapter` says it names one (any other `model`, such as
/// the base model or one of its aliases, means no adapter); the salt is the request's
/// `cache_salt`.
pub fn namespace(
    request: &ParsedRequest<'_>,
    base_model: &str,
    is_adapter: impl Fn(&str) -> bool,
) -> CacheNamespace {
    let mut ns = CacheNamespace::new(base_model);
    let model = request.model();
    if model != base_model && is_adapter(model) {
        ns = ns.with_lora(model);
    }
    if let Some(salt) = request.cache_salt() {
        ns = ns.with_salt(salt);
    }
    ns
}
