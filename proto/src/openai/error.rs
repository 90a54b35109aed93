//! The two error boundaries of the `openai` module and the OpenAI error JSON they become.
//!
//! - [`RequestError`]: a request body that cannot be turned into token ids. Every variant
//!   is the client's fault except [`RequestError::Tokenizer`]; [`RequestError::to_openai`]
//!   maps each to OpenAI's `type`/`param`/`code` and [`RequestError::http_status`] to a
//!   status, so the router and the replica agent answer with identical 400s.
//! - [`LoadError`]: a tokenizer or chat template that cannot be loaded at startup.
//!
//! [`OpenAiError`] is the one place that writes OpenAI's error body,
//! `{"error":{"message":…,"type":…,"param":…,"code":…}}`; the router also uses it for its
//! own 502/503/504 answers.

use std::path::PathBuf;

use serde::Serialize;

/// Why a request body could not be parsed, validated, rendered or tokenized.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// The body is not valid JSON (or repeats a top-level field).
    #[error("could not parse the JSON body of the request: {0}")]
    Json(#[source] serde_json::Error),
    /// The body is JSON but not an object.
    #[error("the request body must be a JSON object")]
    NotAnObject,
    /// A required field is absent or `null`.
    #[error("missing required parameter: '{param}'")]
    MissingField {
        /// The field's name, e.g. `model`.
        param: &'static str,
    },
    /// A known field has the wrong JSON type or an invalid value.
    #[error("invalid '{param}': expected {expected}")]
    InvalidField {
        /// The field's name, e.g. `max_tokens`.
        param: &'static str,
        /// What the field should be, in words.
        expected: &'static str,
    },
    /// A field inside a known field is of the wrong type, e.g. `messages[2].content[0].text`.
    #[error("invalid '{at}': expected {expected}")]
    InvalidAt {
        /// Where the field is.
        at: String,
        /// What it should be, in words.
        expected: &'static str,
    },
    /// `prompt` is an empty list or holds an empty token list, or a text prompt tokenized
    /// to no tokens at all (an empty string with no BOS to add).
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// `prompt` is none of: a string, a list of strings, a list of token ids, a list of
    /// token-id lists.
    #[error(
        "'prompt' must be a string, an array of strings, an array of token ids or an array of \
         token-id arrays"
    )]
    BadPromptType,
    /// A prompt token id is not an integer in `0..2^32`.
    #[error("prompt token ids must be non-negative 32-bit integers")]
    BadTokenId,
    /// A prompt token id is outside the tokenizer's vocabulary.
    #[error("token id {token_id} is out of vocabulary (vocabulary size {vocab_size})")]
    TokenIdOutOfRange {
        /// The offending id.
        token_id: u32,
        /// Ids must be below this.
        vocab_size: u32,
    },
    /// `messages` is an empty list.
    #[error("'messages' must not be empty")]
    EmptyMessages,
    /// A message is not an object, or its `role`/`content` has the wrong type.
    #[error("invalid message at messages[{index}]: {problem}")]
    InvalidMessage {
        /// Position in `messages`.
        index: usize,
        /// What is wrong with it.
        problem: MessageProblem,
    },
    /// A content part that is not text (images, audio, ...): its tokens cannot be computed
    /// from the request alone, so [`crate::openai::Tokenization::prompt_tokens`] refuses the
    /// request (the replica agent answers 400; the router routes it on what is certain,
    /// [`crate::openai::Tokenization::partial_chat_tokens`]).
    #[error("unsupported content part type '{part_type}' at messages[{index}]")]
    UnsupportedContentPart {
        /// Position of the message in `messages`.
        index: usize,
        /// The part's `type`.
        part_type: String,
    },
    /// A `/generate` request (SGLang's) with none of `text`, `input_ids` and `input_embeds`, or
    /// with all three; SGLang's words.
    #[error("Either text, input_ids or input_embeds should be provided.")]
    NoGenerateInput,
    /// A Responses request that continues a stored response (`previous_response_id`): its
    /// prompt starts with a conversation only the replica that stored it has.
    #[error("the prompt continues a stored response, which only the replica that stored it has")]
    StoredConversation,
    /// A completion given as `prompt_embeds` (vLLM with `--enable-prompt-embeds`): it has no
    /// token ids to read. vLLM's words without the flag.
    #[error("You must set `--enable-prompt-embeds` to input `prompt_embeds`.")]
    PromptEmbeds(Box<super::request::EmbedsRequest>),
    /// `continue_final_message` asked for what cannot be done: with a generation prompt, or
    /// with a last message whose text the template does not render as it is (transformers'
    /// checks, which vLLM answers with a 400).
    #[error("{0}")]
    CannotContinue(&'static str),
    /// A request brought its own chat template (`chat_template`, or one in its
    /// `chat_template_kwargs`) and the fleet does not take those; vLLM's words.
    #[error(
        "Chat template is passed with request, but --trust-request-chat-template is not set. \
         Refused request with untrusted chat template."
    )]
    UntrustedChatTemplate,
    /// A chat request, but no chat template is configured for this tokenizer.
    /// A chat that vLLM's Harmony rendering (gpt-oss) refuses, with vLLM's reason.
    #[error("{0}")]
    Harmony(String),

    #[error("no chat template is configured for this model, so chat requests are not supported")]
    NoChatTemplate,
    /// The chat template failed, including a template's own `raise_exception(..)`.
    #[error("chat template error: {0}")]
    Template(#[source] minijinja::Error),
    /// The tokenizer itself failed (not the client's fault).
    #[error("tokenizer failed: {0}")]
    Tokenizer(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// What is wrong with one chat message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MessageProblem {
    /// The message is not a JSON object.
    #[error("a message must be an object")]
    NotAnObject,
    /// `role` is absent.
    #[error("missing 'role'")]
    MissingRole,
    /// `role` is not a string.
    #[error("'role' must be a string")]
    BadRole,
    /// `content` is not a string, null, or a list of content parts.
    #[error("'content' must be a string or an array of content parts")]
    BadContent,
    /// A content part is not an object with a string `type` (and, for text, a string `text`).
    #[error("malformed content part")]
    BadContentPart,
}

impl RequestError {
    /// The HTTP status to answer with: 400 for the client's errors, 500 for ours.
    pub fn http_status(&self) -> u16 {
        match self {
            RequestError::Tokenizer(_) => 500,
            _ => 400,
        }
    }

    /// This error as OpenAI reports it.
    pub fn to_openai(&self) -> OpenAiError {
        use RequestError as E;
        let (kind, param, code): (&str, Option<String>, Option<&str>) = match self {
            E::Json(_) | E::NotAnObject => (INVALID_REQUEST, None, None),
            E::MissingField { param } => {
                (INVALID_REQUEST, Some((*param).into()), Some("missing_required_parameter"))
            }
            E::InvalidField { param, .. } => (INVALID_REQUEST, Some((*param).into()), Some("invalid_value")),
            E::InvalidAt { at, .. } => (INVALID_REQUEST, Some(at.clone()), Some("invalid_value")),
            E::EmptyPrompt => (INVALID_REQUEST, Some("prompt".into()), Some("invalid_value")),
            E::NoGenerateInput => (INVALID_REQUEST, Some("text".into()), Some("missing_required_parameter")),
            E::BadPromptType => (INVALID_REQUEST, Some("prompt".into()), Some("invalid_type")),
            E::BadTokenId | E::TokenIdOutOfRange { .. } => {
                (INVALID_REQUEST, Some("prompt".into()), Some("invalid_value"))
            }
            E::EmptyMessages => (INVALID_REQUEST, Some("messages".into()), Some("empty_array")),
            E::InvalidMessage { index, problem } => {
                let field = match problem {
                    MessageProblem::NotAnObject => "",
                    MessageProblem::MissingRole | MessageProblem::BadRole => ".role",
                    MessageProblem::BadContent | MessageProblem::BadContentPart => ".content",
                };
                (INVALID_REQUEST, Some(format!("messages[{index}]{field}")), Some("invalid_value"))
            }
            E::UnsupportedContentPart { index, .. } => {
                (INVALID_REQUEST, Some(format!("messages[{index}].content")), Some("unsupported_content"))
            }
            E::NoChatTemplate | E::Template(_) => (INVALID_REQUEST, Some("messages".into()), None),
            E::StoredConversation => (INVALID_REQUEST, Some("previous_response_id".into()), None),
            E::PromptEmbeds(_) => (INVALID_REQUEST, Some("prompt_embeds".into()), None),
            E::CannotContinue(_) => (INVALID_REQUEST, Some("continue_final_message".into()), None),
            E::UntrustedChatTemplate => (INVALID_REQUEST, Some("chat_template".into()), None),
            E::Harmony(_) => (INVALID_REQUEST, Some("messages".into()), None),
            E::Tokenizer(_) => ("server_error", None, None),
        };
        OpenAiError { message: self.to_string(), kind: kind.into(), param, code: code.map(Into::into) }
    }
}

const INVALID_REQUEST: &str = "invalid_request_error";

/// An error in OpenAI's shape; [`OpenAiError::to_json`] writes the response body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OpenAiError {
    /// Human-readable explanation.
    pub message: String,
    /// OpenAI's error class: `invalid_request_error`, `server_error`, ...
    #[serde(rename = "type")]
    pub kind: String,
    /// The request field at fault, if any.
    pub param: Option<String>,
    /// A machine-readable code, if any.
    pub code: Option<String>,
}

impl OpenAiError {
    /// An error of OpenAI type `kind` (e.g. `"server_error"`) with no `param` or `code`.
    pub fn new(kind: impl Into<String>, message: impl Into<String>) -> Self {
        Self { message: message.into(), kind: kind.into(), param: None, code: None }
    }

    /// The response body: `{"error":{"message":…,"type":…,"param":…,"code":…}}`.
    pub fn to_json(&self) -> Vec<u8> {
        #[derive(Serialize)]
        struct Body<'a> {
            error: &'a OpenAiError,
        }
        // Serializing plain strings and options into a Vec cannot fail.
        serde_json::to_vec(&Body { error: self }).unwrap_or_default()
    }

    /// The body for a client of Anthropic's Messages API: `{"type":"error","error":{…}}`,
    /// the error object as in [`OpenAiError::to_json`]. Anthropic's SDKs read the outer
    /// `type` and the error's `type` and `message`; OpenAI's read `error` as usual.
    pub fn to_anthropic_json(&self) -> Vec<u8> {
        #[derive(Serialize)]
        struct Body<'a> {
            #[serde(rename = "type")]
            kind: &'static str,
            error: &'a OpenAiError,
        }
        serde_json::to_vec(&Body { kind: "error", error: self }).unwrap_or_default()
    }
}

impl From<&RequestError> for OpenAiError {
    fn from(err: &RequestError) -> Self {
        err.to_openai()
    }
}

/// Why a tokenizer or chat template could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A file could not be read.
    #[error("cannot read {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A `tokenizer.json` could not be parsed by the `tokenizers` crate.
    #[error("cannot load tokenizer {path}: {source}")]
    Tokenizer {
        /// The file (or `<bytes>`).
        path: PathBuf,
        /// The cause.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A `tokenizer_config.json` is not JSON of the expected shape.
    #[error("invalid tokenizer config {path}: {source}")]
    TokenizerConfig {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// A `tokenizer_config.json` has no (default) `chat_template`.
    #[error("{path} has no chat_template")]
    NoChatTemplate {
        /// The file.
        path: PathBuf,
    },
    /// A chat template does not compile.
    #[error("invalid chat template: {0}")]
    Template(#[source] minijinja::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_body_shape() {
        let body = RequestError::MissingField { param: "model" }.to_openai().to_json();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let err = &v["error"];
        assert_eq!(err["type"], "invalid_request_error");
        assert_eq!(err["param"], "model");
        assert_eq!(err["code"], "missing_required_parameter");
        assert!(err["message"].is_string());

        let v: serde_json::Value =
            serde_json::from_slice(&OpenAiError::new("server_error", "boom").to_json()).unwrap();
        assert_eq!(v["error"]["param"], serde_json::Value::Null);
        assert_eq!(v["error"]["code"], serde_json::Value::Null);
    }

    #[test]
    fn message_errors_name_the_field() {
        let err = RequestError::InvalidMessage { index: 2, problem: MessageProblem::BadContent };
        assert_eq!(err.to_openai().param.as_deref(), Some("messages[2].content"));
        assert_eq!(err.http_status(), 400);
        assert_eq!(RequestError::Tokenizer("x".into()).http_status(), 500);
    }
}
