//! The replica's OpenAI-compatible HTTP API (hyper 1, HTTP/1.1 and HTTP/2 on one port).
//!
//! | route | what |
//! |---|---|
//! | `POST /v1/completions` | `generate.rs`: text completions, streamed (SSE) or not |
//! | `POST /v1/chat/completions` | `generate.rs`: chat completions, streamed (SSE) or not |
//! | `POST /v1/messages` | `generate.rs`: Anthropic's Messages API as vLLM serves it (the request read as the chat request vLLM makes of it, `messages.rs` the answer), streamed or not |
//! | `POST /v1/responses` | `generate.rs`: OpenAI's Responses API as vLLM serves it (the request read as the chat request vLLM makes of it, `responses.rs` the answer and the store), streamed or not, or in the background (`background: true`, with `--responses-store`) |
//! | `POST /generate` | `generate.rs`: SGLang's native API (the request read as the completion it amounts to, `sglang.rs` the answer), streamed or not |
//! | `GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel` | `responses.rs`: a stored response (with `--responses-store`) |
//! | `POST /v1/messages/count_tokens` | `admin.rs`: the prompt's token count, `{"input_tokens"}` |
//! | `GET /v1/models` | `admin.rs`: the base model and its LoRA adapters |
//! | `GET /health` | `admin.rs`: 200 with an empty body, as vLLM answers |
//! | `POST /tokenize` | `admin.rs`: the token ids generation would use, vLLM's shape |
//! | `POST /reset_prefix_cache` | `admin.rs`: drop the prefix cache (409 while requests hold blocks) |
//! | `POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter` | `admin.rs`: serve a LoRA adapter (a name: the agent simulates its weights), or stop, as vLLM with runtime LoRA updating |
//! | `GET /metrics` | `metrics.rs`: Prometheus text with vLLM's metric names |
//!
//! With `--api-key`, every `/v1/*` route and `/generate` need `Authorization: Bearer <key>`, as
//! in vLLM and SGLang.
//! Browsers may call it from any origin, as vLLM's defaults allow (`cors.rs`).
//!
//! Streams follow vLLM: `usage` (with `prompt_tokens_details.cached_tokens`) comes in a
//! final chunk, when the request sets `stream_options` with an `include_usage` that is not
//! false or null (`{}` is enough); clients that need the realized cache hit of a stream
//! (kvroute's router and load generator) must set it. With `continuous_usage_stats` too,
//! every chunk carries its choice's counts so far (without the cached tokens, as vLLM's).
//! See `sse.rs` for the frame order.
//!
//! Every response carries `x-request-id` (the client's, or a generated one) and every error
//! is OpenAI's error JSON, built in `error.rs` (under `/v1/messages`, inside Anthropic's
//! `{"type":"error"}` envelope). [`serve`] stops accepting when its shutdown
//! token fires and returns once every open connection has finished its in-flight requests.

mod admin;
mod chat;
mod completions;
mod cors;
mod error;
mod generate;
mod messages;
mod metrics;
mod responses;
mod sampling;
mod sglang;
mod sse;

use error::ApiError;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use kvroute_proto::api_key;
use kvroute_proto::openai::Tokenization;
use kvroute_proto::serve::Tls;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::engine::{Engine, Ranks};

/// Response body of every route: a full buffer, or a stream of SSE frames.
pub(crate) type Body = UnsyncBoxBody<Bytes, Infallible>;

/// What every request handler needs; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

struct Inner {
    ranks: Ranks,
    tokenization: Arc<Tokenization>,
    config: Arc<Config>,
    /// Time since the Unix epoch at startup: the `created` of `/v1/models` entries (in whole
    /// seconds), and `process_start_time_seconds` on the metrics page.
    started: Duration,
    /// Cancelled when the server shuts down; tells a shutdown failure from an engine fault.
    shutdown: CancellationToken,
    /// Responses API responses kept for later requests.
    responses: Arc<responses::Store>,
    /// SGLang's disaggregation's hand-overs ([`crate::bootstrap`]).
    rooms: Arc<crate::bootstrap::Rooms>,
}

impl AppState {
    /// The state the API serves from. `tokenization` must be the one the router uses, so
    /// that `/tokenize`, generation and the router agree on token ids.
    pub fn new(
        ranks: Ranks,
        tokenization: Arc<Tokenization>,
        config: Arc<Config>,
        rooms: Arc<crate::bootstrap::Rooms>,
    ) -> Self {
        let store = config.responses_store;
        AppState {
            inner: Arc::new(Inner {
                ranks,
                tokenization,
                config,
                started: SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default(),
                shutdown: CancellationToken::new(),
                responses: Arc::new(responses::Store::new(store)),
                rooms,
            }),
        }
    }

    /// Rank 0's engine, whose settings are every rank's.
    pub(crate) fn engine(&self) -> &Engine {
        self.inner.ranks.first()
    }

    pub(crate) fn ranks(&self) -> &Ranks {
        &self.inner.ranks
    }

    pub(crate) fn tokenization(&self) -> &Tokenization {
        &self.inner.tokenization
    }

    pub(crate) fn config(&self) -> &Config {
        &self.inner.config
    }

    pub(crate) fn responses(&self) -> &Arc<responses::Store> {
        &self.inner.responses
    }

    pub(crate) fn rooms(&self) -> &Arc<crate::bootstrap::Rooms> {
        &self.inner.rooms
    }

    pub(crate) fn started(&self) -> u64 {
        self.inner.started.as_secs()
    }

    /// Unix seconds at startup, to the microsecond: a restart, even within a second, reports
    /// another.
    pub(crate) fn start_time(&self) -> f64 {
        self.inner.started.as_secs_f64()
    }

    pub(crate) fn shutting_down(&self) -> bool {
        self.inner.shutdown.is_cancelled() || self.ranks().all().iter().any(Engine::is_stopping)
    }

    /// Whether `model` is the base model (or none: `""`, as in vLLM) or one of its LoRA
    /// adapters.
    pub(crate) fn serves(&self, model: &str) -> bool {
        model.is_empty() || model == self.config().model || self.tokenization().is_lora_adapter(model)
    }
}

/// Serves the API on `listener` (over TLS with `tls`) until `shutdown` fires, then stops
/// accepting and returns once every connection has finished the requests it was serving
/// (streams included).
pub async fn serve(listener: TcpListener, state: AppState, tls: Option<Tls>, shutdown: CancellationToken) {
    // Handlers must know as soon as shutdown starts (not once the drain is over), so an
    // engine failure during the drain answers 503 (retry elsewhere) rather than 500.
    let shutting_down = state.inner.shutdown.clone();
    let limits = state.config().serve_limits();
    let watch = shutdown.clone();
    let handler = move |req| handle(state.clone(), req);
    let mark = async move {
        watch.cancelled().await;
        shutting_down.cancel();
    };
    let serving = kvroute_proto::serve::serve_with(listener, handler, limits, tls.as_ref(), shutdown);
    tokio::join!(serving, mark);
}

/// Routes one request and stamps `x-request-id` on the answer.
async fn handle(state: AppState, req: Request<Incoming>) -> Response<Body> {
    let request_id = request_id(&req);
    let path = routed_path(&req);
    // Errors on Anthropic's paths in Anthropic's envelope.
    let anthropic = matches!(route(path), Some((_, Route::Messages | Route::CountTokens)));
    let error = |e: &ApiError| {
        if anthropic { json_response(e.status, e.error.to_anthropic_json()) } else { error_response(e) }
    };
    let cross_origin = req.headers().contains_key(header::ORIGIN);
    let mut response = match route(path) {
        _ if let Some(preflight) = cors::preflight(req.method(), req.headers()) => preflight,
        _ if !authorized(state.config(), path, &req) => {
            json_response(StatusCode::UNAUTHORIZED, br#"{"error":"Unauthorized"}"#.to_vec())
        }
        Some((allowed, _)) if req.method() != allowed => {
            let mut r = error(&ApiError::method_not_allowed(req.method(), path));
            if let Ok(allow) = HeaderValue::from_str(allowed.as_str()) {
                r.headers_mut().insert(header::ALLOW, allow);
            }
            r
        }
        Some((_, route)) => match dispatch(route, &state, req, &request_id).await {
            Ok(response) => response,
            Err(e) => error(&e),
        },
        None => error_response(&ApiError::not_found(path)),
    };
    if cross_origin {
        cors::allow(&mut response);
    }
    if let Ok(value) = HeaderValue::from_str(&request_id) {
        response.headers_mut().insert(X_REQUEST_ID, value);
    }
    response
}

const X_REQUEST_ID: &str = "x-request-id";

/// Whether `req` may go on under `--api-key`, as vLLM's check has it: paths under `/v1` (and
/// SGLang's `/generate`) need `Authorization: Bearer <key>` (preflight `OPTIONS` excepted); the
/// rest are open.
fn authorized(config: &Config, path: &str, req: &Request<Incoming>) -> bool {
    let Some(key) = &config.api_key else { return true };
    let given = req.headers().get(header::AUTHORIZATION).map(HeaderValue::as_bytes);
    !api_key::needs_key(req.method(), path) || api_key::bearer_matches(given, &[key])
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    Completions,
    ChatCompletions,
    Messages,
    Responses,
    /// SGLang's native `POST /generate`.
    Generate,
    /// `GET /v1/responses/{id}`.
    Retrieve,
    /// `POST /v1/responses/{id}/cancel`.
    Cancel,
    CountTokens,
    Models,
    Health,
    Tokenize,
    Detokenize,
    ResetPrefixCache,
    LoadLora,
    UnloadLora,
    Metrics,
    Version,
}

/// The route at `path` and the one method it accepts.
fn route(path: &str) -> Option<(Method, Route)> {
    Some(match path {
        "/v1/completions" => (Method::POST, Route::Completions),
        "/v1/chat/completions" => (Method::POST, Route::ChatCompletions),
        "/v1/messages" => (Method::POST, Route::Messages),
        "/v1/messages/count_tokens" => (Method::POST, Route::CountTokens),
        "/v1/models" => (Method::GET, Route::Models),
        "/health" => (Method::GET, Route::Health),
        "/tokenize" => (Method::POST, Route::Tokenize),
        "/detokenize" => (Method::POST, Route::Detokenize),
        "/reset_prefix_cache" => (Method::POST, Route::ResetPrefixCache),
        "/v1/load_lora_adapter" => (Method::POST, Route::LoadLora),
        "/v1/unload_lora_adapter" => (Method::POST, Route::UnloadLora),
        "/metrics" => (Method::GET, Route::Metrics),
        "/version" => (Method::GET, Route::Version),
        "/v1/responses" => (Method::POST, Route::Responses),
        "/generate" => (Method::POST, Route::Generate),
        _ => match stored_response(path)? {
            (_, false) => (Method::GET, Route::Retrieve),
            (_, true) => (Method::POST, Route::Cancel),
        },
    })
}

/// The request's path as routed: without trailing slashes.
fn routed_path(req: &Request<Incoming>) -> &str {
    let path = req.uri().path();
    if path.len() > 1 { path.trim_end_matches('/') } else { path }
}

/// The id of `/v1/responses/{id}` or `/v1/responses/{id}/cancel`, and whether it is the latter.
fn stored_response(path: &str) -> Option<(&str, bool)> {
    let rest = path.strip_prefix("/v1/responses/")?;
    let (id, cancel) = match rest.strip_suffix("/cancel") {
        Some(id) => (id, true),
        None => (rest, false),
    };
    (!id.is_empty() && !id.contains('/')).then_some((id, cancel))
}

async fn dispatch(
    route: Route,
    state: &AppState,
    req: Request<Incoming>,
    request_id: &str,
) -> Result<Response<Body>, ApiError> {
    use kvroute_proto::openai::Endpoint;
    match route {
        Route::Completions => {
            let rank = data_parallel_rank(state, &req)?;
            let body = read_body(state, req).await?;
            generate::generate(state, Endpoint::Completions, &body, request_id, rank).await
        }
        Route::ChatCompletions => {
            let rank = data_parallel_rank(state, &req)?;
            let body = read_body(state, req).await?;
            generate::generate(state, Endpoint::ChatCompletions, &body, request_id, rank).await
        }
        Route::Messages => {
            let rank = data_parallel_rank(state, &req)?;
            let body = read_body(state, req).await?;
            generate::generate(state, Endpoint::Messages, &body, request_id, rank).await
        }
        Route::Responses => {
            let rank = data_parallel_rank(state, &req)?;
            let body = read_body(state, req).await?;
            generate::generate(state, Endpoint::Responses, &body, request_id, rank).await
        }
        Route::Generate => {
            let rank = data_parallel_rank(state, &req)?;
            let body = read_body(state, req).await?;
            generate::generate(state, Endpoint::Generate, &body, request_id, rank).await
        }
        Route::Retrieve | Route::Cancel => {
            let (id, _) = stored_response(routed_path(&req)).unwrap_or_default();
            let store = state.responses();
            let json = if route == Route::Cancel { store.cancel(id)? } else { store.retrieve(id)? };
            Ok(json_response(StatusCode::OK, json))
        }
        Route::CountTokens => admin::count_tokens(state, &read_body(state, req).await?),
        Route::Models => Ok(admin::models(state)),
        Route::Health => Ok(empty(StatusCode::OK)),
        // vLLM's `{"version": ...}`, with the agent's own version (it is no vLLM).
        Route::Version => {
            let version = serde_json::json!({"version": env!("CARGO_PKG_VERSION")});
            Ok(json_response(StatusCode::OK, version.to_string().into_bytes()))
        }
        Route::Tokenize => {
            let body = read_body(state, req).await?;
            admin::tokenize(state, &body)
        }
        Route::Detokenize => admin::detokenize(state, &read_body(state, req).await?),
        Route::ResetPrefixCache => admin::reset_prefix_cache(state).await,
        Route::LoadLora => admin::load_lora(state, &read_body(state, req).await?),
        Route::UnloadLora => admin::unload_lora(state, &read_body(state, req).await?),
        Route::Metrics => Ok(metrics::render(state)),
    }
}

/// The rank `X-data-parallel-rank` sends a request to, as vLLM (0.14 and later) reads it: a
/// value that is no integer is ignored (the balancer picks), an integer that is no rank of
/// this replica is refused.
fn data_parallel_rank(state: &AppState, req: &Request<Incoming>) -> Result<Option<u32>, ApiError> {
    let value = req.headers().get(X_DATA_PARALLEL_RANK).and_then(|v| v.to_str().ok());
    let Some(rank) = value.and_then(python_int) else { return Ok(None) };
    let ranks = state.ranks().count();
    match u32::try_from(rank) {
        Ok(rank) if (rank as usize) < ranks => Ok(Some(rank)),
        _ => Err(ApiError::bad_request(format!("data_parallel_rank {rank} is out of range [0, {ranks})."))),
    }
}

const X_DATA_PARALLEL_RANK: &str = "x-data-parallel-rank";

/// `text` as Python's `int()` reads it (spaces around, a sign, ASCII digits with single
/// underscores between them), saturated to `i64`; `None` if it is no integer.
fn python_int(text: &str) -> Option<i64> {
    let text = text.trim();
    let (negative, digits) = match text.strip_prefix('-') {
        Some(digits) => (true, digits),
        None => (false, text.strip_prefix('+').unwrap_or(text)),
    };
    let well_formed = digits.split('_').all(|run| !run.is_empty() && run.bytes().all(|b| b.is_ascii_digit()));
    if !well_formed {
        return None;
    }
    let value = (digits.bytes().filter(u8::is_ascii_digit))
        .fold(0i64, |value, d| value.saturating_mul(10).saturating_add(i64::from(d - b'0')));
    Some(if negative { -value } else { value })
}

/// The whole request body, refused with 413 past `max_body_bytes`.
async fn read_body(state: &AppState, req: Request<Incoming>) -> Result<Bytes, ApiError> {
    let limit = state.config().max_body_bytes;
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(ApiError::too_large(limit));
    }
    let deadline = Duration::from_millis(state.config().body_timeout_ms);
    let read = tokio::time::timeout(deadline, Limited::new(req.into_body(), limit).collect());
    match read.await.map_err(|_| ApiError::body_timeout(deadline))? {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(ApiError::too_large(limit)),
        Err(e) => Err(ApiError::bad_request(format!("could not read the request body: {e}"))),
    }
}

/// The client's `x-request-id` if it is a sane token, else a fresh random one.
fn request_id(req: &Request<Incoming>) -> String {
    req.headers()
        .get(X_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 256 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map_or_else(|| format!("{:032x}", rand::random::<u128>()), str::to_owned)
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

pub(crate) fn full(body: impl Into<Bytes>) -> Body {
    Full::new(body.into()).boxed_unsync()
}

pub(crate) fn empty(status: StatusCode) -> Response<Body> {
    let mut response = Response::new(full(Bytes::new()));
    *response.status_mut() = status;
    response
}

/// A JSON response with `status`.
pub(crate) fn json_response(status: StatusCode, body: Vec<u8>) -> Response<Body> {
    let mut response = Response::new(full(body));
    *response.status_mut() = status;
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

pub(crate) fn error_response(err: &ApiError) -> Response<Body> {
    json_response(err.status, err.error.to_json())
}
