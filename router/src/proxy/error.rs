//! Every error the router itself answers with, in one place: OpenAI's error JSON shape (for
//! `/v1/messages*`, inside Anthropic's envelope, [`Client`]), the right status, and the
//! request id (in the body's message and the `x-request-id` header).
//!
//! | status | when |
//! |---|---|
//! | 400 | a path passed through that is one of the router's own paths spelled otherwise (percent-encoded, a trailing slash) or has dot segments; malformed body (not JSON, wrong types, empty prompt, bad token ids), prompt longer than `--max-prompt-tokens`, `max_tokens` above `--max-completion-tokens`, a prompt the replica's `/tokenize` refused (`--remote-tokenize`); a WebSocket handshake with a body |
//! | 401 | a request to `/v1/*`, or to the router's LoRA fan-out (SGLang's spellings outside `/v1` too), without one of `--api-key`'s keys |
//! | 403 | a LoRA adapter change while `--lora-updates` is off |
//! | 404 / 405 | unknown path / wrong method (with `Allow`) |
//! | 408 | the client sent nothing of its request body for `--idle-timeout-ms` (routed, or streamed to a replica) |
//! | 413 | body larger than `--max-body-bytes` |
//! | 502 | the replica failed before answering, and so did every retry; a LoRA adapter change some replicas took and some did not (`partial_fan_out`), or none answered within `--control-timeout-ms`; a `101` that does not switch to `websocket` |
//! | 503 | no healthy replica; a replica's own 503 with no other replica left to take the request; every replica saturated or the router at its in-flight limit, past `--queue-timeout-ms` in line or with `--max-queued` waiting already ([`super::queue`]); (`--remote-tokenize`) no replica asked could tokenize the prompt |
//! | 504 | the replica did not start answering within `--first-byte-timeout-ms` (for a streamed upload: from its end, or from when the replica last took some of it), or a WebSocket handshake within `--control-timeout-ms` |

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode};
use kvroute_proto::openai::{OpenAiError, RequestError};

use super::body::{ProxyBody, full};

/// Whose API a request is in, which decides the error envelope: OpenAI's
/// `{"error":{…}}`, or for `/v1/messages*` Anthropic's `{"type":"error","error":{…}}` (the
/// same error object inside).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Client {
    OpenAi,
    Anthropic,
}

impl Client {
    pub fn of_path(path: &str) -> Self {
        match path.strip_prefix(kvroute_proto::openai::request::anthropic::MESSAGES_PATH) {
            Some(rest) if rest.is_empty() || rest.starts_with('/') => Client::Anthropic,
            _ => Client::OpenAi,
        }
    }
}

/// An error message of the router's, naming the request it answers (its `x-request-id`), so
/// a client that logs only the message can find the request in the router's logs.
pub fn with_request_id(message: &str, request_id: &str) -> String {
    format!("{message} (request id {request_id})")
}

/// An error the router answers itself.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error(transparent)]
    BadRequest(#[from] RequestError),
    #[error("the request body could not be read: {0}")]
    BodyRead(String),
    /// The client left while its request body came (no answer can reach it).
    #[error("the client left before its request body ended")]
    ClientLeft,
    #[error("{0}")]
    Refused(String),
    #[error("the request body exceeds the limit of {limit} bytes")]
    BodyTooLarge { limit: usize },
    #[error("the request body stalled: nothing arrived for {timeout_ms} ms")]
    BodyTimeout { timeout_ms: u64 },
    #[error("the prompt has {tokens} tokens, more than the limit of {limit}")]
    PromptTooLong { tokens: u64, limit: u64 },
    /// `param` is the request's name for it (`max_tokens`, `max_output_tokens`).
    #[error("{param} {asked} exceeds the limit of {limit}")]
    TooManyTokens { param: &'static str, asked: u64, limit: u64 },
    #[error("unknown path {0}")]
    NotFound(String),
    /// A request the router cannot pass on as it came (RFC 9112 §6.1's answer to a transfer
    /// coding it does not know).
    #[error("{0}")]
    NotImplemented(String),
    /// A request whose key has `limit` requests in flight (`--max-in-flight-per-key`).
    #[error(
        "this API key has {limit} requests in flight, as many as it may (--max-in-flight-per-key); retry when one ends"
    )]
    KeyLimit { limit: u32 },
    /// A request to `/v1/*` without one of `--api-key`'s keys.
    #[error("a valid API key is required (Authorization: Bearer <key>)")]
    Unauthorized,
    #[error("method {method} is not allowed here; use {allow}")]
    MethodNotAllowed { method: String, allow: &'static str },
    #[error("{0}")]
    BadPath(String),
    #[error("no replica can take the request: {0}")]
    Unavailable(String),
    /// No room: the router at `--max-in-flight`, or every replica the request could go to at
    /// `--max-in-flight-per-replica`, and the request could not wait or waited in vain
    /// ([`super::queue`]).
    /// `replicas`: those that could take it once they have room.
    #[error("no replica can take the request: {reason}")]
    Saturated { reason: String, replicas: Vec<kvroute_proto::ReplicaId> },
    #[error("replica {replica} failed before answering: {reason}")]
    Upstream { replica: String, reason: String },
    /// A replica refused the request with 503 (overloaded, shutting down), and no other was
    /// left to take it.
    #[error(
        "replica {replica} answered 503 Service Unavailable, and no other replica could take the request"
    )]
    RefusedBusy { replica: String },
    #[error("replica {replica} did not start answering within {timeout_ms} ms")]
    Timeout { replica: String, timeout_ms: u64 },
    /// A request sent to every replica that some took and some did not.
    #[error("{0}")]
    FanOut(String),
    /// Something the router is not set up to let clients do.
    #[error("{0}")]
    Forbidden(String),
    /// A Responses API id that no replica has (vLLM's own answer for one it has not).
    #[error("Response with id '{0}' not found.")]
    UnknownResponse(String),
    /// Every replica asked refused the request alike, with a client error (a wrong API key,
    /// say): their status, and what the first said.
    #[error("every replica answered {status}: {said}")]
    RefusedEverywhere { status: StatusCode, said: String },
}

impl ProxyError {
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::BadRequest(e) => {
                StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::BAD_REQUEST)
            }
            // nginx's status for a client that closed first.
            ProxyError::ClientLeft => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            ProxyError::BodyRead(_)
            | ProxyError::Refused(_)
            | ProxyError::PromptTooLong { .. }
            | ProxyError::TooManyTokens { .. }
            | ProxyError::BadPath(_) => StatusCode::BAD_REQUEST,
            ProxyError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ProxyError::NotFound(_) | ProxyError::UnknownResponse(_) => StatusCode::NOT_FOUND,
            ProxyError::NotImplemented(_) => StatusCode::NOT_IMPLEMENTED,
            ProxyError::Forbidden(_) => StatusCode::FORBIDDEN,
            ProxyError::Unauthorized => StatusCode::UNAUTHORIZED,
            ProxyError::KeyLimit { .. } => StatusCode::TOO_MANY_REQUESTS,
            ProxyError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ProxyError::Unavailable(_) | ProxyError::Saturated { .. } | ProxyError::RefusedBusy { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ProxyError::Upstream { .. } | ProxyError::FanOut(_) => StatusCode::BAD_GATEWAY,
            ProxyError::Timeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::RefusedEverywhere { status, .. } => *status,
        }
    }

    /// The replica the error is about, if it is one's.
    pub fn replica(&self) -> Option<&str> {
        match self {
            ProxyError::Upstream { replica, .. }
            | ProxyError::Timeout { replica, .. }
            | ProxyError::RefusedBusy { replica } => Some(replica),
            _ => None,
        }
    }

    /// A short, fixed label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            ProxyError::BadRequest(_)
            | ProxyError::BodyRead(_)
            | ProxyError::Refused(_)
            | ProxyError::BadPath(_) => "bad_request",
            ProxyError::ClientLeft => "client_left",
            ProxyError::BodyTooLarge { .. } => "too_large",
            ProxyError::BodyTimeout { .. } => "body_timeout",
            ProxyError::PromptTooLong { .. } | ProxyError::TooManyTokens { .. } => "over_limit",
            ProxyError::NotFound(_) | ProxyError::UnknownResponse(_) => "not_found",
            ProxyError::NotImplemented(_) => "not_implemented",
            ProxyError::MethodNotAllowed { .. } => "method_not_allowed",
            ProxyError::Unavailable(_) => "unavailable",
            ProxyError::RefusedBusy { .. } => "replica_unavailable",
            ProxyError::Saturated { .. } => "saturated",
            ProxyError::Upstream { .. } => "upstream_failed",
            ProxyError::Timeout { .. } => "upstream_timeout",
            ProxyError::FanOut(_) => "fan_out",
            ProxyError::Forbidden(_) => "forbidden",
            ProxyError::Unauthorized => "unauthorized",
            ProxyError::KeyLimit { .. } => "key_limit",
            ProxyError::RefusedEverywhere { .. } => "refused_everywhere",
        }
    }

    fn openai(&self) -> OpenAiError {
        match self {
            ProxyError::BadRequest(e) => e.to_openai(),
            ProxyError::BodyRead(_)
            | ProxyError::ClientLeft
            | ProxyError::Refused(_)
            | ProxyError::BodyTooLarge { .. }
            | ProxyError::BodyTimeout { .. }
            | ProxyError::BadPath(_)
            | ProxyError::Forbidden(_)
            | ProxyError::MethodNotAllowed { .. }
            | ProxyError::NotImplemented(_)
            | ProxyError::RefusedEverywhere { .. } => {
                OpenAiError::new("invalid_request_error", self.to_string())
            }
            ProxyError::PromptTooLong { .. } => {
                let mut e = OpenAiError::new("invalid_request_error", self.to_string());
                e.param = Some("prompt".into());
                e
            }
            ProxyError::TooManyTokens { param, .. } => {
                let mut e = OpenAiError::new("invalid_request_error", self.to_string());
                e.param = Some((*param).into());
                e
            }
            ProxyError::NotFound(_) => {
                let mut e = OpenAiError::new("invalid_request_error", self.to_string());
                e.code = Some("not_found".into());
                e
            }
            // OpenAI's type and code for a rate limit.
            ProxyError::KeyLimit { .. } => {
                let mut e = OpenAiError::new("requests", self.to_string());
                e.code = Some("rate_limit_exceeded".into());
                e
            }
            // OpenAI's type and code for a wrong key.
            ProxyError::Unauthorized => {
                let mut e = OpenAiError::new("invalid_request_error", self.to_string());
                e.code = Some("invalid_api_key".into());
                e
            }
            ProxyError::UnknownResponse(_) => {
                let mut e = OpenAiError::new("invalid_request_error", self.to_string());
                e.param = Some("response_id".into());
                e.code = Some("404".into());
                e
            }
            ProxyError::Unavailable(_)
            | ProxyError::Saturated { .. }
            | ProxyError::RefusedBusy { .. }
            | ProxyError::Upstream { .. }
            | ProxyError::Timeout { .. } => OpenAiError::new("server_error", self.to_string()),
            ProxyError::FanOut(_) => {
                let mut e = OpenAiError::new("server_error", self.to_string());
                e.code = Some("partial_fan_out".into());
                e
            }
        }
    }

    /// The response: OpenAI error JSON with the status and request id.
    pub fn into_response(self, request_id: &str) -> Response<ProxyBody> {
        self.into_response_for(request_id, Client::OpenAi)
    }

    /// [`ProxyError::into_response`], the body in the envelope `client` reads.
    pub fn into_response_for(self, request_id: &str, client: Client) -> Response<ProxyBody> {
        let mut err = self.openai();
        err.message = with_request_id(&err.message, request_id);
        let body = match client {
            Client::OpenAi => err.to_json(),
            Client::Anthropic => err.to_anthropic_json(),
        };
        let mut response = Response::new(full(Bytes::from(body)));
        *response.status_mut() = self.status();
        let headers = response.headers_mut();
        headers.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Ok(id) = HeaderValue::from_str(request_id) {
            headers.insert(super::forward::X_REQUEST_ID, id);
        }
        match self {
            ProxyError::Unavailable(_)
            | ProxyError::Saturated { .. }
            | ProxyError::RefusedBusy { .. }
            | ProxyError::KeyLimit { .. } => {
                headers.insert(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            ProxyError::MethodNotAllowed { allow, .. } => {
                headers.insert(http::header::ALLOW, HeaderValue::from_static(allow));
            }
            _ => {}
        }
        response
    }
}
