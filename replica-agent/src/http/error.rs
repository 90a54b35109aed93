//! Every error the HTTP API answers with, produced in one place: a status code plus an
//! [`OpenAiError`] body, `{"error":{"message","type","param","code"}}`.
//!
//! | case | status | `type` / `code` |
//! |---|---|---|
//! | malformed body, bad field, too long for the context | 400 | `invalid_request_error` |
//! | unknown model | 404 | `invalid_request_error` / `model_not_found` |
//! | unloading an adapter not loaded | 404 | `invalid_request_error` / `lora_not_found` |
//! | unknown path | 404 | `invalid_request_error` / `not_found` |
//! | wrong method | 405 | `invalid_request_error` / `method_not_allowed` |
//! | cache reset while requests hold blocks | 409 | `invalid_request_error` / `cache_busy` |
//! | body over `max_body_bytes` | 413 | `invalid_request_error` / `request_too_large` |
//! | engine failure | 500 | `server_error` |
//! | overloaded, shutting down | 503 | `server_error` / `overloaded`, `shutting_down` |

use hyper::StatusCode;
use kvroute_proto::openai::{OpenAiError, RequestError};

const INVALID_REQUEST: &str = "invalid_request_error";
const SERVER_ERROR: &str = "server_error";

/// An error response: the status and the OpenAI-shaped body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub error: OpenAiError,
}

impl ApiError {
    fn new(
        status: StatusCode,
        kind: &str,
        message: impl Into<String>,
        param: Option<&str>,
        code: Option<&str>,
    ) -> Self {
        ApiError {
            status,
            error: OpenAiError {
                message: message.into(),
                kind: kind.into(),
                param: param.map(Into::into),
                code: code.map(Into::into),
            },
        }
    }

    /// A 400 about one request field.
    pub fn invalid_field(param: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, INVALID_REQUEST, message, Some(param), Some("invalid_value"))
    }

    /// A 400 whose cause is not one field (e.g. an unreadable body).
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, INVALID_REQUEST, message, None, None)
    }

    /// Prompt plus completion longer than the model's context, worded as vLLM words it.
    pub fn context_length(max_model_len: u32, prompt_tokens: usize, max_tokens: u64, param: &str) -> Self {
        let what = if param == "messages" { "messages" } else { "prompt" };
        Self::new(
            StatusCode::BAD_REQUEST,
            INVALID_REQUEST,
            format!(
                "This model's maximum context length is {max_model_len} tokens. However, you requested {} tokens \
                 ({prompt_tokens} in the {what}, {max_tokens} in the completion). Please reduce the length of the \
                 {what} or completion.",
                u128::from(max_tokens) + prompt_tokens as u128
            ),
            Some(param),
            Some("context_length_exceeded"),
        )
    }

    /// The prompt needs more KV-cache blocks than the replica can hold for one request. vLLM
    /// refuses to start with a `max_model_len` its cache cannot hold; the simulated replica
    /// takes the configuration and refuses the prompt instead, as the client's error.
    pub fn prompt_exceeds_cache(max_prompt_tokens: usize, prompt_tokens: usize, param: &str) -> Self {
        let what = if param == "messages" { "messages" } else { "prompt" };
        Self::new(
            StatusCode::BAD_REQUEST,
            INVALID_REQUEST,
            format!(
                "The {what} has {prompt_tokens} tokens; this replica's KV cache holds at most \
                 {max_prompt_tokens} prompt tokens for one request. Please reduce the length of the {what}."
            ),
            Some(param),
            Some("context_length_exceeded"),
        )
    }

    /// The request names a model this replica does not serve (vLLM answers 404 too).
    pub fn model_not_found(model: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            INVALID_REQUEST,
            format!("The model `{model}` does not exist."),
            Some("model"),
            Some("model_not_found"),
        )
    }

    /// An unload for an adapter that is not loaded (vLLM answers 404).
    pub fn lora_not_found(name: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            INVALID_REQUEST,
            format!("The lora adapter '{name}' cannot be found."),
            Some("lora_name"),
            Some("lora_not_found"),
        )
    }

    pub fn not_found(path: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            INVALID_REQUEST,
            format!("Unknown path: {path}"),
            None,
            Some("not_found"),
        )
    }

    pub fn method_not_allowed(method: &hyper::Method, path: &str) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            INVALID_REQUEST,
            format!("Method {method} is not allowed on {path}"),
            None,
            Some("method_not_allowed"),
        )
    }

    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            INVALID_REQUEST,
            format!("The request body is larger than the limit of {limit} bytes"),
            None,
            Some("request_too_large"),
        )
    }

    /// The request's body did not all arrive within `limit`.
    pub fn body_timeout(limit: std::time::Duration) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            INVALID_REQUEST,
            format!("The request body did not arrive within {} ms", limit.as_millis()),
            None,
            Some("request_timeout"),
        )
    }

    pub fn cache_busy(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, INVALID_REQUEST, message, None, Some("cache_busy"))
    }

    pub fn overloaded(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, SERVER_ERROR, message, None, Some("overloaded"))
    }

    pub fn shutting_down() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            SERVER_ERROR,
            "The replica is shutting down",
            None,
            Some("shutting_down"),
        )
    }

    /// The engine failed the request (e.g. it can never fit in the cache).
    pub fn engine_failed(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, SERVER_ERROR, message, None, None)
    }
}

impl From<RequestError> for ApiError {
    fn from(err: RequestError) -> Self {
        let status = StatusCode::from_u16(err.http_status()).unwrap_or(StatusCode::BAD_REQUEST);
        ApiError { status, error: err.to_openai() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_errors_keep_their_status() {
        let e = ApiError::from(RequestError::MissingField { param: "model" });
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.error.param.as_deref(), Some("model"));
        let e = ApiError::from(RequestError::Tokenizer("boom".into()));
        assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
    }

    #[test]
    fn context_length_message_is_vllms() {
        let e = ApiError::context_length(100, 90, 20, "prompt");
        assert!(e.error.message.starts_with(
            "This model's maximum context length is 100 tokens. However, you requested 110 tokens"
        ));
        assert_eq!(e.error.code.as_deref(), Some("context_length_exceeded"));
    }
}
