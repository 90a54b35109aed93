//! The routes around generation: `GET /v1/models`, `POST /tokenize`,
//! `POST /reset_prefix_cache`, `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
//! (`GET /health` is an empty 200 in [`super`]).
//!
//! `/tokenize` takes vLLM's two request shapes, `{"model"?, "prompt", "add_special_tokens"?}`
//! and `{"model"?, "messages", "add_generation_prompt"?, ...}`, parses them with the same
//! parser and [`Tokenization`] as generation, and answers
//! `{"count", "max_model_len", "tokens"}`: exactly the ids a generation request with the
//! same fields would be prefilled with, so the router can rely on it.
//!
//! [`Tokenization`]: kvroute_proto::openai::Tokenization

use hyper::{Response, StatusCode};
use kvroute_proto::openai::request::parse_object;
use kvroute_proto::openai::{Endpoint, ParsedRequest, RequestError};
use serde::{Deserialize, Serialize};

use super::error::ApiError;
use super::{AppState, Body, empty, json_response};
use crate::engine::ResetError;

#[derive(Serialize)]
struct ModelList<'a> {
    object: &'static str,
    data: Vec<ModelCard<'a>>,
}

/// One entry of `/v1/models`, as vLLM lists it.
#[derive(Serialize)]
struct ModelCard<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    owned_by: &'static str,
    root: &'a str,
    parent: Option<&'a str>,
    max_model_len: u32,
}

/// `GET /v1/models`: the base model, then each LoRA adapter with the base as its parent.
pub(super) fn models(state: &AppState) -> Response<Body> {
    let config = state.config();
    let card = |id, parent| ModelCard {
        id,
        object: "model",
        created: state.started(),
        owned_by: "kvroute",
        root: id,
        parent,
        max_model_len: config.max_model_len,
    };
    let adapters = state.tokenization().lora_adapters();
    let mut data = vec![card(config.model.as_str(), None)];
    data.extend(adapters.iter().map(|a| card(a.as_str(), Some(config.model.as_str()))));
    let body = serde_json::to_vec(&ModelList { object: "list", data }).unwrap_or_default();
    json_response(StatusCode::OK, body)
}

#[derive(Serialize)]
struct TokenizeResponse<'a> {
    count: usize,
    max_model_len: u32,
    tokens: &'a [u32],
}

/// `POST /tokenize`.
pub(super) fn tokenize(state: &AppState, body: &[u8]) -> Result<Response<Body>, ApiError> {
    // Not a JSON object: the request parser below says exactly what is wrong.
    let messages = parse_object(body, &["messages"]).map_or(None, |[messages]| messages);
    let endpoint = if messages.is_some() { Endpoint::ChatCompletions } else { Endpoint::Completions };
    // `model` is optional, as everywhere: none is the base model.
    let request = ParsedRequest::parse(endpoint, body)?;
    if !state.serves(request.model()) {
        return Err(ApiError::model_not_found(request.model()));
    }
    let single = !matches!(&request, ParsedRequest::Completion(c) if c.prompt.len() > 1);
    let mut prompts = match state.tokenization().prompt_tokens(&request) {
        // vLLM's /tokenize answers an empty prompt with no ids (a router asks it for the ids
        // the tokenizer adds); only generation refuses one.
        Err(RequestError::EmptyPrompt) if single => vec![Vec::new()],
        prompts => prompts?,
    };
    if prompts.len() != 1 {
        return Err(ApiError::invalid_field("prompt", "/tokenize takes one prompt, not a batch"));
    }
    let tokens = prompts.pop().unwrap_or_default();
    let response = TokenizeResponse {
        count: tokens.len(),
        max_model_len: state.config().max_model_len,
        tokens: &tokens,
    };
    Ok(json_response(StatusCode::OK, serde_json::to_vec(&response).unwrap_or_default()))
}

/// `POST /detokenize`: vLLM's `{"model", "tokens"}` to `{"prompt"}`, the ids' text as the
/// tokenizer decodes it. The built-in tokenizer cannot (it hashes words): a 400 says so.
pub(super) fn detokenize(state: &AppState, body: &[u8]) -> Result<Response<Body>, ApiError> {
    #[derive(serde::Deserialize)]
    struct Detokenize {
        #[serde(default)]
        model: Option<String>,
        tokens: Vec<u32>,
    }
    let request: Detokenize = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid_field("tokens", format!("expected {{\"tokens\": [ids]}}: {e}")))?;
    let model = request.model.unwrap_or_default();
    if !state.serves(&model) {
        return Err(ApiError::model_not_found(&model));
    }
    let tokenizer = state.tokenization().tokenizer();
    let vocab_size = tokenizer.vocab_size();
    if let Some(id) = request.tokens.iter().find(|&&id| id >= vocab_size) {
        return Err(ApiError::invalid_field(
            "tokens",
            format!("token id {id} is not below the vocabulary's {vocab_size}"),
        ));
    }
    let prompt = tokenizer.decode(&request.tokens).ok_or_else(|| {
        ApiError::invalid_field(
            "tokens",
            "the built-in tokenizer cannot decode ids (start the agent with --tokenizer)",
        )
    })?;
    Ok(json_response(StatusCode::OK, serde_json::json!({ "prompt": prompt }).to_string().into_bytes()))
}

/// `POST /v1/messages/count_tokens`: the token count of a Messages request's prompt (with
/// no generation prompt's difference: vLLM renders it the same way).
pub(super) fn count_tokens(state: &AppState, body: &[u8]) -> Result<Response<Body>, ApiError> {
    let body = with_max_tokens(body);
    let (read_as, readable) = state.tokenization().readable(Endpoint::Messages, &body)?;
    let request = ParsedRequest::parse(read_as, &readable)?;
    if !state.serves(request.model()) {
        return Err(ApiError::model_not_found(request.model()));
    }
    let tokens: usize = state.tokenization().prompt_tokens(&request)?.iter().map(Vec::len).sum();
    Ok(json_response(StatusCode::OK, super::messages::token_count(tokens)))
}

/// A count_tokens body has no `max_tokens`; the conversion wants one.
fn with_max_tokens(body: &[u8]) -> Vec<u8> {
    let trimmed = body.trim_ascii();
    match trimmed.strip_prefix(b"{") {
        Some(rest) if rest.trim_ascii() == b"}" => br#"{"max_tokens":1}"#.to_vec(),
        Some(rest) => [&br#"{"max_tokens":1,"#[..], rest].concat(),
        None => body.to_vec(),
    }
}

/// `POST /reset_prefix_cache`: 200 once every rank's cache is empty; 409 while running
/// requests hold blocks. (vLLM does not reset then either, but answers 200 all the same and
/// only logs it: the 409 tells a caller, such as `loadgen compare`, to try again.)
pub(super) async fn reset_prefix_cache(state: &AppState) -> Result<Response<Body>, ApiError> {
    match state.ranks().reset_prefix_cache().await {
        Ok(blocks) => {
            tracing::info!(blocks, "prefix cache reset");
            Ok(empty(StatusCode::OK))
        }
        Err(ResetError::Busy(e)) => Err(ApiError::cache_busy(format!("cannot reset the prefix cache: {e}"))),
        Err(ResetError::ShuttingDown) => Err(ApiError::shutting_down()),
    }
}

/// A `/v1/load_lora_adapter` or `/v1/unload_lora_adapter` body, as vLLM reads it.
#[derive(Deserialize)]
struct LoraRequest {
    lora_name: String,
    /// Required to load (the agent has no weights to read: only its presence counts).
    lora_path: Option<String>,
    /// Load again an adapter that is loaded already (vLLM: reload its weights in place).
    #[serde(default)]
    load_inplace: bool,
}

fn lora_request(body: &[u8], loading: bool) -> Result<LoraRequest, ApiError> {
    let request: LoraRequest = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid LoRA request: {e}")))?;
    if request.lora_name.is_empty() || loading && request.lora_path.as_deref().is_none_or(str::is_empty) {
        return Err(ApiError::bad_request("Both 'lora_name' and 'lora_path' must be provided."));
    }
    Ok(request)
}

/// `POST /v1/load_lora_adapter`: requests may name the adapter from now on (its blocks in
/// its own cache namespace, as vLLM's). vLLM's answers: 200 with a line of text, 400 for an
/// adapter already loaded (unless `load_inplace`).
pub(super) fn load_lora(state: &AppState, body: &[u8]) -> Result<Response<Body>, ApiError> {
    let LoraRequest { lora_name, load_inplace, .. } = lora_request(body, true)?;
    let added = lora_name != state.config().model && state.tokenization().add_lora_adapter(&lora_name);
    if !(added || load_inplace && state.tokenization().is_lora_adapter(&lora_name)) {
        return Err(ApiError::bad_request(format!(
            "The lora adapter '{lora_name}' has already been loaded."
        )));
    }
    tracing::info!(lora_name, "LoRA adapter loaded");
    Ok(text_response(format!("Success: LoRA adapter '{lora_name}' added successfully.")))
}

/// `POST /v1/unload_lora_adapter`: requests naming the adapter get 404 from now on (its
/// blocks stay cached until evicted, as vLLM's). 404 for an adapter not loaded.
pub(super) fn unload_lora(state: &AppState, body: &[u8]) -> Result<Response<Body>, ApiError> {
    let LoraRequest { lora_name, .. } = lora_request(body, false)?;
    if !state.tokenization().remove_lora_adapter(&lora_name) {
        return Err(ApiError::lora_not_found(&lora_name));
    }
    tracing::info!(lora_name, "LoRA adapter unloaded");
    Ok(text_response(format!("Success: LoRA adapter '{lora_name}' removed successfully.")))
}

fn text_response(text: String) -> Response<Body> {
    let mut response = Response::new(super::full(bytes::Bytes::from(text)));
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}
